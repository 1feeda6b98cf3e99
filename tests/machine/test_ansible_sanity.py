"""The collection fleetctl.sglang passes ansible-test's sanity tests (validate-modules, compile,
import, pep8, ansible-doc) on Python 3.11, none of them skipped; it and the example playbook pass
`ansible-lint --offline --profile production` (the repository's .ansible-lint).

`fleetctl collection build --out` makes the layout ansible-test needs
(.../ansible_collections/fleetctl/sglang) in a temporary directory. ansible-test keeps its
venvs and pip bootstrap under ~/.ansible/test: here HOME is a directory in the wheel cache made
for it (reused by later runs), holding tests/get_pip_standin.py as its cached get-pip script
(ansible-test would download that one from ci-files.testing.ansible.com, which the test
machines cannot reach) and this machine's pip settings for it. ansible-lint is the one
scripts/setup.sh pins in its ansible-core 2.19 venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from fleetctl.collection import build
from fleetctl.wheels import cache_dir

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["validate-modules", "compile", "import", "pep8", "ansible-doc"]
PIP_VERSION = "24.2"  # the pip ansible-test 2.18/2.19 bootstraps into its venvs
LINT_VENV = "ansible-core-2.19"  # scripts/setup.sh's venv holding ansible-lint
LINTED = ["playbooks/ansible/defrag-tier0.yml", "ansible_collections/fleetctl/sglang"]


def pip_settings() -> dict[str, str]:
    """This machine's pip options as `pip config list` gives them: {option: value}."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True).stdout
    settings = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        settings[key.split(".", 1)[1]] = value.strip().strip("'\"")
    return settings


def test_sanity_passes_and_nothing_is_skipped(tmp_path):
    root = build.build(tmp_path)
    home = cache_dir() / "ansible-test-home"
    cache = home / ".ansible" / "test" / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    (cache / f"get_pip_{PIP_VERSION.replace('.', '_')}.py").write_text((ROOT / "tests" / "get_pip_standin.py").read_text())
    (cache / "get_pip_settings.json").write_text(json.dumps(pip_settings()))
    cmd = [str(Path(sys.executable).parent / "ansible-test"), "sanity", "--python", "3.11", "--requirements"]
    for t in TESTS:
        cmd += ["--test", t]
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=1500,
                       env={"HOME": str(home), "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
                            "LANG": "C.UTF-8"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    for t in TESTS:
        assert f'Running sanity test "{t}"' in out, out[-4000:]
    skipped = [line for line in out.splitlines() if "skip" in line.lower()]
    assert not skipped, skipped


def test_ansible_lint_production_profile_passes(tmp_path):
    """ansible-lint, offline, production profile, on the shipped example playbook and the
    collection's committed tree: no failure and no warning. The playbook's modules resolve from
    the collection built for this checkout (ANSIBLE_COLLECTIONS_PATH)."""
    build.build(tmp_path)
    bindir = cache_dir() / "venvs" / LINT_VENV / "bin"
    assert (bindir / "ansible-lint").exists(), f"no ansible-lint in {bindir.parent}: run scripts/setup.sh"
    r = subprocess.run([str(bindir / "ansible-lint"), "--offline", "--profile", "production", "--nocolor", *LINTED],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(tmp_path), NO_COLOR="1",
                                PATH=f"{bindir}:{os.environ['PATH']}"))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert "Profile 'production' was required, and it passed" in out, out[-3000:]
    assert "Passed: 0 failure(s), 0 warning(s)" in out, out[-3000:]
