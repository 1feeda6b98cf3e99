#!/usr/bin/env bash
# Install everything fleetctl, its lab and its tests need on a fresh Debian machine (as root).
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need_apt+=(openssh-client)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v flock >/dev/null 2>&1 || need_apt+=(util-linux)
command -v sudo >/dev/null 2>&1 || need_apt+=(sudo)  # become (ansible_become) and its lab users
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
# a compiler cache: torch.utils.cpp_extension puts ccache before the compiler when it is on PATH,
# so the same kernel sources built again (other build keys, other lab hosts, later runs) compile once
command -v ccache >/dev/null 2>&1 || need_apt+=(ccache)
[ -x /usr/bin/ninja ] || need_apt+=(ninja-build)  # on the PATH of SSH sessions (lab hosts)
# the lab's container host (lab.add_container_host): rootful Podman on runc (this machine's cgroups
# are in hybrid mode, which crun refuses)
command -v podman >/dev/null 2>&1 || need_apt+=(podman)
[ -x /usr/sbin/runc ] || command -v runc >/dev/null 2>&1 || need_apt+=(runc)
# tests/machine/test_report_browser.py: the HTML report in Debian's chromium, driven through its chromedriver
[ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] || need_apt+=(chromium chromium-driver)
if [ ${#need_apt[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
# tests/machine/test_inventory_ansible.py makes a venv for the ansible extra (Debian's python3 needs python3-venv)
if ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
fi
# torch==2.13.0 is a CPU build that pip takes from this machine's own disk. The test extra holds
# ansible-core (ansible-playbook, ansible-test) for the fleetctl.sglang collection's tests.
"$PY" -m pip install -q --disable-pip-version-check -e '.[kernel,test]'

# SGLang's own benchmark clients (`fleetctl validate --load`), as the lab hosts run them: under each
# host's /opt/sglang/venv/bin/python, a --no-deps venv of the SGLang wheel that sees this
# interpreter's site-packages (--system-site-packages, as it sees torch). The modules they import,
# pinned, wheels only, one pip call: `sglang.bench_serving` of 0.4.6.post5 and 0.5.2 imports aiohttp,
# tqdm, transformers (AutoTokenizer, for the stand-in's byte-level tokenizer), pybase64 (0.5.2),
# numpy, requests, IPython, pydantic; 0.5.23's Rust client (`sglang.benchmark.rust_client`) imports
# the sglang package: psutil, pyzmq, msgspec, pillow, starlette, orjson (and triton, torch: above).
# The Python clients of 0.5.10 and 0.5.23 import torchvision too, which cannot run here (PyPI's
# wheels are CUDA builds; this machine's torch is the CPU one), so they stay "not run" in the lab.
"$PY" -m pip install -q --disable-pip-version-check --only-binary :all: aiohttp==3.14.3 tqdm==4.70.1 \
    transformers==5.17.0 pybase64==1.5.1 psutil==7.2.2 pyzmq==27.2.0 msgspec==0.22.0 pillow==12.3.0 \
    starlette==1.7.0 numpy==2.4.6 requests==2.34.2 orjson==3.8.3 ipython==8.12.3 pydantic==2.13.4

# The fleetctl.sglang collection runs on each ansible-core series fleetctl allows (the `ansible`
# extra: >=2.18,<2.20), the newest patch of each pinned, from a venv of its own per series in the
# wheel cache, <cache>/venvs/ansible-core-SERIES (tests/fleet/test_fleet_ansible.py), with
# fleetctl's own requirements (the action plugins import fleetctl, from this checkout's
# PYTHONPATH); ansible-lint, pinned, in the newest (tests/machine/test_ansible_sanity.py).
# A venv is made again only when what it holds would change (.fleetctl-ready holds that).
ANSIBLE_VENVS=("2.18:ansible-core==2.18.19" "2.19:ansible-core==2.19.14 ansible-lint==26.10.1")
venvs=$("$PY" -c 'from fleetctl.wheels import cache_dir; print(cache_dir() / "venvs")')
fleetctl_requires=$("$PY" -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
for entry in "${ANSIBLE_VENVS[@]}"; do
    home="$venvs/ansible-core-${entry%%:*}"
    want="${entry#*:} $fleetctl_requires ($("$PY" -VV | head -1))"
    if [ "$(cat "$home/.fleetctl-ready" 2>/dev/null)" != "$want" ]; then
        rm -rf "$home"
        "$PY" -m venv "$home"
        # shellcheck disable=SC2086  # word splitting: each requirement is one argument
        "$home/bin/python" -m pip install -q --disable-pip-version-check ${entry#*:} $fleetctl_requires
        echo "$want" > "$home/.fleetctl-ready"
    fi
done

# The real uv and pipx, pinned, for tests/fleet/test_fleet_installs_user_tools.py (SGLang installed as
# its docs and these tools put it: `uv tool install`, `pipx install`, `uv venv` + `uv pip install`,
# each run by a local user on a lab host), with the pip wheel pipx's shared venv upgrades to
# (offline there): `pip install --target` into <cache>/venvs/install-tools, which any user can run.
tools=$("$PY" -c 'from fleetctl.wheels import cache_dir; print(cache_dir() / "venvs" / "install-tools")')
tools_want="uv==0.13.9 pipx==1.7.1 pip==25.1.1 ($("$PY" -VV | head -1))"
if [ "$(cat "$tools/.fleetctl-ready" 2>/dev/null)" != "$tools_want" ]; then
    rm -rf "$tools"
    "$PY" -m pip install -q --disable-pip-version-check --target "$tools" uv==0.13.9 pipx==1.7.1
    "$PY" -m pip download -q --disable-pip-version-check --no-deps -d "$tools/wheels" pip==25.1.1
    echo "$tools_want" > "$tools/.fleetctl-ready"
fi

# The documentation site's builder, mkdocs-material (pinned), in a venv of its own in the wheel cache
# (tests/machine/test_docs_site.py builds the site strictly with it).
bash scripts/docs.sh install

# The SGLang releases the lab and the tests use, downloaded once into the shared wheel cache
# (wheels only, no deps). 0.4.10 and 0.5.19 are read by tests/unit/test_verifyroute.py only: two
# releases no lab host runs, on which route-verify-attention's finding must work unshown.
"$PY" - <<'PYEOF'
from fleetctl.wheels import ensure_wheel
for v in ("0.4.6.post5", "0.4.10", "0.5.2", "0.5.10", "0.5.19", "0.5.23"):
    print("wheel cache:", ensure_wheel(v).name)
PYEOF
