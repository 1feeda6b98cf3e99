"""Installs on this machine, with real processes, real venvs, real pip installs and git: where
SGLang is (asked of each interpreter), servers behind launcher wrappers, lost GPUs, and apply,
status, rollback per install (`--install`) through the local connection.

Cases 11 (nvidia-smi with a lost GPU: run here; what each nvidia-smi answer reads as is in the
recorded cases, tests/unit/probes/gpus/), 12 (editable install) and 14 (servers behind launchers).
What cannot exist here is a stand-in, named as one: the `sglang` package built below is a
STAND-IN (a few files with real-shaped allocator call sites; its `launch_server` only sleeps,
since there is no GPU and no model), and `nvidia-smi` is a stand-in script on PATH that answers
the query it is asked with the case's rows.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fleetctl import probes
from fleetctl.probes.facts import gpus

PROBES = sorted({*probes.modules_for("facts.host"), "facts.gittree"})

# ---- case 11: nvidia-smi with a lost GPU --------------------------------------------------

LOST = "Unable to determine the device handle for gpu 0000:18:00.0: Unknown Error"
H100 = {"name": "NVIDIA H100 80GB HBM3", "memory.total": "81559", "driver_version": "570.133.20",
        "compute_cap": "9.0"}
NVIDIA_SMI = r'''#!/usr/bin/env python3
# STAND-IN nvidia-smi: answers --query-gpu=... with the rows of rows.json (the fields it is
# asked, in order), error lines first, then exits with the given status.
import json, os, sys
doc = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "rows.json")))
q = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--query-gpu="))
for line in doc["stdout_lines"]:
    print(line)
for row in doc["rows"]:
    print(", ".join(row[f] for f in q.split(",")))
sys.stderr.write(doc.get("stderr", ""))
sys.exit(doc["exit"])
'''


def run_nvidia_smi(tmp_path: Path, monkeypatch, stdout_lines, rows, code, stderr=""):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "nvidia-smi").write_text(NVIDIA_SMI)
    (bindir / "nvidia-smi").chmod(0o755)
    (bindir / "rows.json").write_text(json.dumps({"stdout_lines": stdout_lines, "rows": rows, "exit": code,
                                                  "stderr": stderr}))
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return gpus.gpu_facts()


def h100(i: int) -> dict:
    return dict(H100, index=str(i), **{"pci.bus_id": f"00000000:{0x18 + i:02X}:00.0"})


@pytest.mark.parametrize("code", [0, 15])
def test_case11_lost_gpu_keeps_the_healthy_ones_and_names_the_lost_one(tmp_path, monkeypatch, code):
    rows, errors, reason = run_nvidia_smi(tmp_path, monkeypatch, [LOST], [h100(i) for i in (1, 2, 3)], code)
    assert [g["index"] for g in rows] == [1, 2, 3]
    assert rows[0] == {"index": 1, "pci_bus_id": "00000000:19:00.0", "name": "NVIDIA H100 80GB HBM3",
                       "memory_total_mib": 81559, "driver": "570.133.20", "compute_cap": "9.0"}
    assert errors == [{"index": None, "pci_bus_id": "0000:18:00.0", "error": LOST}]
    assert reason.startswith("1 of 4 GPUs lost: 0000:18:00.0 (") and LOST in reason


# ---- installs built for real: stand-in sglang projects, venvs, pip ------------------------

ALLOCATOR = '''\
class TokenToKVPoolAllocator:
    def __init__(self, size, dtype, device, kvcache, need_sort: bool):
        self.need_sort = need_sort


class PagedTokenToKVPoolAllocator(TokenToKVPoolAllocator):
    def __init__(self, size, page_size, dtype, device, kvcache, need_sort: bool):
        super().__init__(size, dtype, device, kvcache, need_sort)
'''
MODEL_RUNNER = '''\
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


def init_memory_pool(server_args, size, dtype, device, kvcache, page_size):
    need_sort = server_args.disaggregation_mode in ("decode", "prefill")
    if page_size == 1:
        allocator = TokenToKVPoolAllocator(size, dtype, device, kvcache, need_sort=need_sort)
    else:
        allocator = None
    if allocator is None:
        # paged
        allocator = PagedTokenToKVPoolAllocator(size, page_size, dtype, device, kvcache, need_sort=need_sort)
    return allocator
'''
LAUNCH_SERVER = '''\
"""STAND-IN for sglang.launch_server (no GPU, no model here): sleeps until killed; with
--schedulers N it first starts N children titled as SGLang titles its schedulers."""
import subprocess, sys, time
if "--schedulers" in sys.argv:
    for i in range(int(sys.argv[sys.argv.index("--schedulers") + 1])):
        subprocess.Popen([sys.executable, "-c", "import setproctitle, time; "
                          "setproctitle.setproctitle('sglang::scheduler_TP%d'); time.sleep(120)" % i])
time.sleep(120)
'''
ROUTER = '''\
"""STAND-IN for sglang_router.launch_server: --dp-size N workers (spawned, as the router does),
each listening on a TCP port of 127.0.0.1, then sleeps until killed."""
import multiprocessing, socket, sys, time


def worker():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    time.sleep(120)


if __name__ == "__main__":
    n = int(sys.argv[sys.argv.index("--dp-size") + 1])
    ctx = multiprocessing.get_context("spawn")
    for _ in range(n):
        ctx.Process(target=worker).start()
    time.sleep(120)
'''
CONDA = '''\
"""STAND-IN for `conda run -n ENV CMD...`: runs CMD with ENV's bin first on PATH and
CONDA_PREFIX set, and stays its parent (as conda run does)."""
import os, subprocess, sys
args = sys.argv[1:]
env_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "envs", args[2])
env = dict(os.environ, PATH=os.path.join(env_dir, "bin") + ":" + os.environ["PATH"], CONDA_PREFIX=env_dir)
env.pop("VIRTUAL_ENV", None)
sys.exit(subprocess.call(args[3:], env=env))
'''


def make_project(root: Path, version: str) -> Path:
    """A STAND-IN sglang source tree laid out as SGLang's (python/pyproject.toml, python/sglang/),
    setuptools backend with packages.find; returns the `python` directory (the project)."""
    proj = root / "python"
    files = {"pyproject.toml": textwrap.dedent(f'''\
                [build-system]
                requires = ["setuptools>=70.1"]
                build-backend = "setuptools.build_meta"

                [project]
                name = "sglang"
                version = "{version}"

                [tool.setuptools.packages.find]
                include = ["sglang*"]
                '''),
             "sglang/__init__.py": "", "sglang/version.py": f'__version__ = "{version}"\n',
             "sglang/launch_server.py": LAUNCH_SERVER,
             "sglang/srt/__init__.py": "", "sglang/srt/mem_cache/__init__.py": "",
             "sglang/srt/mem_cache/allocator.py": ALLOCATOR,
             "sglang/srt/model_executor/__init__.py": "",
             "sglang/srt/model_executor/model_runner.py": MODEL_RUNNER,
             "sglang_router/__init__.py": "", "sglang_router/launch_server.py": ROUTER}
    for rel, text in files.items():
        (proj / rel).parent.mkdir(parents=True, exist_ok=True)
        (proj / rel).write_text(text)
    return proj


def make_venv(path: Path) -> Path:
    """A venv (symlinked python, as `python -m venv` makes it) that sees this interpreter's
    setuptools and pip (no network, no build isolation)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(path)], check=True)
    return path / "bin" / "python"


def pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", "--disable-pip-version-check", *args], check=True, timeout=300)


@pytest.fixture(scope="module")
def installs():
    """base: a venv with a stand-in sglang 0.4.6.post5 wheel and a stand-in `conda` launcher;
    base/envs/sglang: a venv with a stand-in sglang 0.5.5 wheel; editable: a venv with the
    0.5.5 checkout installed `pip install -e` (case 12), a git work tree owned by `nobody`.
    Under a directory others may enter (pytest's own tmp dirs are root-only), removed at the end."""
    import shutil
    import tempfile
    root = Path(tempfile.mkdtemp(prefix="fleetctl-installs-"))
    root.chmod(0o755)
    try:
        yield _build_installs(root)
    finally:
        shutil.rmtree(root)


def _build_installs(root: Path) -> dict:
    wheels = root / "wheels"
    for version in ("0.4.6.post5", "0.5.5"):
        proj = make_project(root / f"src-{version}", version)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
                        "--no-build-isolation", "-w", str(wheels), str(proj)], check=True, timeout=300)
    base = make_venv(root / "base")
    pip(base, str(next(wheels.glob("sglang-0.4.6.post5-*.whl"))))
    (root / "base" / "bin" / "conda").write_text(CONDA)
    env = make_venv(root / "base" / "envs" / "sglang")
    pip(env, str(next(wheels.glob("sglang-0.5.5-*.whl"))))
    checkout = make_project(root / "sgl-workspace" / "sglang", "0.5.5")
    editable = make_venv(root / "editable")
    pip(editable, "-e", str(checkout))
    # a git work tree owned by another user (as a developer's checkout is): git must run as them
    work = checkout.parent
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    subprocess.run(git + ["add", "python/pyproject.toml", "python/sglang", "python/sglang_router"], check=True)
    subprocess.run(git + ["commit", "-qm", "stand-in sglang 0.5.5"], check=True)
    subprocess.run(["chown", "-R", "nobody:nogroup", str(work)], check=True)
    return {"root": root, "base": base, "env": env, "checkout": checkout, "editable": editable, "wheels": wheels}


def probe(**params) -> dict:
    """Run the facts probe as fleetctl does (the bundle on stdin of a python -c WRAPPER)."""
    params = {"python": None, "scan": True, "with_sources": False, **params}
    r = subprocess.run([sys.executable, "-c", probes.WRAPPER], input=probes.bundle("facts.host", params),
                       capture_output=True, timeout=300)
    return probes.parse_output(r.stdout, r.stderr, r.returncode)


def site_packages(python: Path) -> str:
    return next(str(p) for p in (python.parent.parent / "lib").glob("python3*/site-packages"))


def computed(origins: list[dict]) -> list[tuple[str, int]]:
    return [(o["file"], o["line"]) for o in origins if not o["literal"] and not o["expr"].isidentifier()]


RUNNER = "sglang/srt/model_executor/model_runner.py"


def test_case12_editable_install_is_found_where_import_resolves(installs):
    out = probe(python=str(installs["editable"]))
    checkout = installs["checkout"]
    sg = out["facts"]["sglang"]
    assert sg == {"version": "0.5.5", "location": str(checkout), "package_dir": str(checkout / "sglang"),
                  "install": "editable"}
    assert [(s["file"], s["line"], s["need_sort"]["passing"]) for s in out["allocator_call_sites"]] == \
        [(RUNNER, 7, "keyword"), (RUNNER, 12, "keyword")]
    assert computed(out["need_sort_origins"]) == [(RUNNER, 5)]
    assert out["scan"]["error"] is None
    [inst] = out["installs"]
    assert inst["id"] == f"host:{checkout / 'sglang'}" and inst["sglang"] == sg
    assert inst["python"]["path"] == str(installs["editable"])


def test_a_wheel_install_is_a_wheel(installs):
    out = probe(python=str(installs["env"]))
    sp = site_packages(installs["env"])
    assert out["facts"]["sglang"] == {"version": "0.5.5", "location": sp, "package_dir": f"{sp}/sglang",
                                      "install": "wheel"}


def test_case12_missing_package_directory_is_an_error_not_an_empty_scan(installs, tmp_path):
    """The editable finder points at a checkout whose package directory is gone: scan.error, and
    the inspect job fails the host with that reason."""
    checkout = installs["checkout"]
    moved = checkout.with_name("python-moved")
    checkout.rename(moved)
    try:
        out = probe(python=str(installs["editable"]))
    finally:
        moved.rename(checkout)
    [inst] = out["installs"]
    sp = site_packages(installs["editable"])
    assert inst["sglang"]["package_dir"] is None and inst["sglang"]["location"] == sp
    assert inst["scan"]["error"].startswith(f"sglang package directory not found under {sp}")
    assert out["scan"]["error"] == inst["scan"]["error"]
    from fleetctl.engine.gather import install_errors
    assert install_errors(out) == [f"{inst['id']}: {inst['scan']['error']}"]


def test_idle_interpreters_are_asked_only_with_an_sglang_distribution(installs, tmp_path):
    from fleetctl.probes.facts.host import may_have_sglang
    assert may_have_sglang(str(installs["env"])) and may_have_sglang(str(installs["editable"]))
    assert not may_have_sglang(str(make_venv(tmp_path / "empty")))


def test_an_idle_interpreter_with_only_a_pth_naming_a_checkout_is_asked(installs):
    """No distribution at all, only a `.pth` line putting a checkout on sys.path (`conda develop`,
    or by hand): still an install, so the interpreter is asked (as nobody: under a directory
    others may enter), and it finds the checkout. A `.pth` naming a directory without sglang, a
    FIFO named `.pth` (never opened: it would hang) and a symlinked `.pth` do not count."""
    from fleetctl.probes.facts.host import may_have_sglang
    tmp_path = installs["root"] / "pth-case"
    tmp_path.mkdir(mode=0o755)
    py = make_venv(tmp_path / "pth")
    sp = Path(site_packages(py))
    os.mkfifo(sp / "a-fifo.pth")
    (sp / "other.pth").write_text("# a comment\nimport os\n" + str(tmp_path) + "\n")
    (tmp_path / "elsewhere.pth").write_text(str(installs["checkout"]) + "\n")
    (sp / "linked.pth").symlink_to(tmp_path / "elsewhere.pth")
    t0 = time.monotonic()
    assert not may_have_sglang(str(py))
    (sp / "sglang-dev.pth").write_text(str(installs["checkout"]) + "\n")
    assert may_have_sglang(str(py)) and time.monotonic() - t0 < 30
    (sp / "a-fifo.pth").unlink()  # site.py itself would block opening it
    out = probe(python=str(py), scan=False)  # asked as fleetctl asks it: the checkout, through the .pth
    [inst] = [i for i in out["installs"] if i["python"]["path"] == str(py)]
    assert inst["sglang"]["package_dir"] == str(installs["checkout"] / "sglang"), inst
    assert inst["sglang"]["install"] == "checkout"


def test_primary_install_rule():
    """The server with the lowest pid names the primary install; with no server, the only
    install; with several and no server, none, and facts say why."""
    from fleetctl.probes.facts.host import SEVERAL, primary
    a, b = {"id": "host:/a/sglang"}, {"id": "host:/b/sglang"}
    servers = [{"pid": 40, "install": "host:/b/sglang"}, {"pid": 7, "install": "host:/a/sglang"},
               {"pid": 3, "install": None}]
    assert primary([a, b], servers) == (a, None)
    assert primary([a, b], servers[:1]) == (b, None)
    assert primary([b], []) == (b, None)
    assert primary([a, b], []) == (None, SEVERAL)
    assert primary([], [])[0] is None and primary([], [])[1]


@pytest.fixture
def started():
    """Start process trees (new sessions) and kill them, whole, at the end."""
    procs = []

    def start(argv, **kw):
        p = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
        procs.append(p)
        return p

    yield start
    for p in procs:  # the group, and descendants that left it (torchrun starts its worker in a session of its own)
        try:
            pids = descendants(p.pid) if p.poll() is None else set()
        except FileNotFoundError:  # one exited while we read the tree
            pids = set()
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def descendants(pid: int) -> set[int]:
    kids = {int(c) for t in Path(f"/proc/{pid}/task").iterdir()
            for c in (t / "children").read_text().split()}
    return kids.union(*(descendants(k) for k in kids)) if kids else set()


def wait_for(pred, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


def servers_of(out: dict, root: int) -> list[dict]:
    tree = descendants(root) | {root}
    return [s for s in out["facts"]["servers"] if s["pid"] in tree]


def server_pid(root: int, module: str) -> int:
    """The pid in `root`'s tree whose argv runs `-m module` with a python."""
    def find():
        for pid in descendants(root) | {root}:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            # its own program is the module (torchrun's is torch.distributed.run, with the same words)
            if argv[:1] != [b"timeout"] and b"-m" in argv and argv[argv.index(b"-m") + 1:][:1] == [module.encode()] \
                    and os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("python"):
                if b"conda" not in b" ".join(argv):
                    return pid
        return None
    return wait_for(find)


def test_case14_conda_run_under_timeout_is_one_server_on_the_env_install(installs, started):
    base, env = installs["base"], installs["env"]
    p = started(["timeout", "45", str(base), str(base.parent / "conda"), "run", "-n", "sglang", "python", "-m",
                 "sglang.launch_server", "--model-path", "/models/example", "--port", "30003"])
    pid = server_pid(p.pid, "sglang.launch_server")
    out = probe()
    [s] = servers_of(out, p.pid)
    assert (s["pid"], s["kind"], s["port"], s["model_path"]) == (pid, "launch_server", 30003, "/models/example")
    assert s["python"] == str(env.parent / "python")  # the env's, found on its own PATH as argv[0] "python"
    sp = site_packages(env)
    assert s["install"] == f"host:{sp}/sglang"
    inst = next(i for i in out["installs"] if i["id"] == s["install"])
    assert inst["sglang"]["version"] == "0.5.5" and pid in inst["servers"]
    assert computed(inst["need_sort_origins"]) == [(RUNNER, 5)]
    # the base env's 0.4.6.post5 is never asked: the launcher is no interpreter candidate
    assert all(c["python"] != str(base) for c in out["facts"]["interpreter_discovery"]["considered"])
    lowest = min(out["facts"]["servers"], key=lambda x: x["pid"])
    assert out["facts"]["sglang"] == next(i for i in out["installs"] if i["id"] == lowest["install"])["sglang"]


def test_case14_venv_on_path_without_virtual_env(installs, started):
    """Variant B: `env -u VIRTUAL_ENV PATH=<venv>/bin:... python3 -m sglang.launch_server`, under
    timeout and nohup: the venv's python3 (argv[0] on the process's PATH), not the base it links to."""
    env = installs["env"]
    p = started(["timeout", "45", "nohup", "env", "-u", "VIRTUAL_ENV", f"PATH={env.parent}:/usr/bin:/bin",
                 "CUDA_VISIBLE_DEVICES=2,3", "python3", "-m", "sglang.launch_server", "--tp", "2", "--port", "30001",
                 "--schedulers", "2"])
    pid = server_pid(p.pid, "sglang.launch_server")
    wait_for(lambda: sum(1 for k in descendants(pid)
                         if Path(f"/proc/{k}/cmdline").read_bytes().startswith(b"sglang::")) == 2)
    [s] = servers_of(probe(), p.pid)
    assert (s["pid"], s["port"], s["tp_size"], s["python"]) == (pid, 30001, 2, str(env.parent / "python3"))
    assert (s["processes"], s["workers"]) == (2, [])  # its sglang:: titled schedulers, counted under it
    assert (s["cuda_visible_devices"], s["gpu_ids"]) == ("2,3", ["2", "3"])
    assert s["install"] == f"host:{site_packages(env)}/sglang"


def test_checkout_in_the_servers_working_directory_wins(installs, started, tmp_path):
    """A server started in a checkout (`cd sglang/python; python -m sglang.launch_server`) with a
    wheel of another release in its venv imports the checkout: so does fleetctl."""
    checkout = installs["checkout"]
    base = installs["base"]
    p = started([str(base), "-m", "sglang.launch_server", "--port", "30005"], cwd=str(checkout))
    out = probe()
    [s] = servers_of(out, p.pid)
    inst = next(i for i in out["installs"] if i["id"] == s["install"])
    assert inst["sglang"] == {"version": "0.5.5", "location": str(checkout), "package_dir": str(checkout / "sglang"),
                              "install": "checkout"}
    assert s["import_path"][0] == str(checkout)


def test_checkout_on_the_servers_pythonpath_wins_unless_the_server_ignores_it(installs, started):
    """PYTHONPATH as the server saw it at start (its /proc/PID/environ), not the probe's; a server
    run with -E ignores it, and so does fleetctl for that server."""
    checkout, base = installs["checkout"], installs["base"]
    env = dict(os.environ, PYTHONPATH=str(checkout))
    p = started([str(base), "-m", "sglang.launch_server", "--port", "30006"], cwd="/", env=env)
    q = started([str(base), "-E", "-m", "sglang.launch_server", "--port", "30007"], cwd="/", env=env)
    out = probe()
    [s] = servers_of(out, p.pid)
    [t] = servers_of(out, q.pid)
    assert s["install"] == f"host:{checkout / 'sglang'}" and s["import_path"] == ["/", str(checkout)]
    assert t["install"] == f"host:{site_packages(base)}/sglang" and t["import_path"] == ["/"]


def test_router_with_dp_workers_is_one_server(installs, started):
    env = installs["env"]
    p = started([str(env), "-m", "sglang_router.launch_server", "--dp-size", "2", "--port", "30010"])

    def listening():
        out = probe(scan=False)
        ss = servers_of(out, p.pid)
        return out if ss and len(ss[0]["workers"]) == 2 and all(w["ports"] for w in ss[0]["workers"]) else None
    out = wait_for(listening, 60)
    [s] = servers_of(out, p.pid)
    assert (s["pid"], s["kind"], s["dp_size"], s["port"]) == (p.pid, "router", 2, 30010)
    ports = [w["ports"][0] for w in s["workers"]]
    for port in ports:  # each is really a listening port
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert s["install"] == f"host:{site_packages(env)}/sglang"


WRAPPERS = {
    # a non-Python launcher that stays the server's parent (sudo forks, then waits); to root, as
    # the test's interpreter may sit where another user cannot execute it (pyenv under /root)
    "sudo -u": lambda env: ["sudo", "-u", "root", str(env)],
    # uv (a Rust binary) runs `python` from the venv it is given, prepended to the child's PATH
    "uv run": lambda env: [shutil.which("uv") or "uv", "run", "--no-project", "--offline", "--python", str(env),
                           "--", "python"],
    # torchrun is Python whose program is its own (torch.distributed.run): its worker is the server
    "torchrun": lambda env: [str(env), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"],
    "timeout": lambda env: ["timeout", "60", str(env)],
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_a_server_behind_a_launcher_is_one_server_on_the_envs_install(installs, started, wrapper, tmp_path):
    """Each launcher of case 14 in front of `python -m sglang.launch_server` from the env venv:
    exactly one server in the tree, the Python process itself (not the launcher), its own
    interpreter (the venv's, not the launcher's), on the env's install."""
    env = installs["env"]
    port = 30020 + sorted(WRAPPERS).index(wrapper)
    p = started([*WRAPPERS[wrapper](env), "-m", "sglang.launch_server", "--port", str(port)], cwd="/",
                env=dict(os.environ, UV_CACHE_DIR=str(tmp_path / "uv-cache"), TORCHELASTIC_ERROR_FILE=""))
    pid = server_pid(p.pid, "sglang.launch_server")
    [s] = wait_for(lambda: servers_of(probe(scan=False), p.pid), 60)
    assert (s["pid"], s["kind"], s["port"]) == (pid, "launch_server", port), s
    assert pid != p.pid and os.path.realpath(s["python"]) == os.path.realpath(env)
    assert os.path.dirname(s["python"]) == str(env.parent), s["python"]  # the venv's bin, not the base's
    assert s["install"] == f"host:{site_packages(env)}/sglang"


def test_the_last_of_a_repeated_option_wins_as_with_argparse():
    from fleetctl.probes.facts import procs, topology
    argv = ["/v/bin/python", "-m", "sglang.launch_server", "--port", "30000", "--tp", "2", "--port=30001"]
    assert (topology.option(argv, "--port"), topology.option(argv, "--tp-size", "--tp"), topology.option(argv, "--host")) == \
        ("30001", "2", None)
    assert procs.python_program(["python3", "-u", "-X", "dev", "-Wignore", "-m", "sglang.launch_server", "--x"]) == \
        ("u", "m", "sglang.launch_server", ["--x"])
    assert procs.python_program(["python", "-um", "sglang.launch_server"])[1:3] == ("m", "sglang.launch_server")
    assert procs.server_kind(["/opt/conda/bin/python", "/opt/conda/bin/conda", "run", "-n", "e", "python", "-m",
                              "sglang.launch_server"]) is None


@pytest.mark.parametrize("name", PROBES)
def test_probe_modules_are_stdlib_py38(name):
    import ast
    src = probes.source(name)
    tree = ast.parse(src, feature_version=(3, 8))
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
    assert mods <= sys.stdlib_module_names
    assert "print(" not in src


# ---- apply, status, rollback per install, through the local connection ---------------------

@pytest.fixture
def local(tmp_path, installs):
    """This machine as one host (ansible_connection: local, the editable venv's python), a
    fleet for it and a state dir of the test's own (never this machine's /var/lib/fleetctl)."""
    from fleetctl import inventory
    from fleetctl.connection import Settings
    from fleetctl.engine.fleet import Fleet
    inv = tmp_path / "hosts.yaml"
    inv.write_text(f"all:\n  hosts:\n    here:\n      ansible_connection: local\n"
                   f"      fleetctl_python: {installs['editable']}\n")
    hosts = inventory.load(inv).select("all")
    with Fleet(Settings(), forks=1, timeout=300) as fleet:
        yield fleet, hosts, str(tmp_path / "state")


def apply_to(local, install: str, **opts):
    from fleetctl.engine.playbooks.apply import ApplyOptions, check_then_apply
    from fleetctl.paths import find_playbook
    from fleetctl.engine.playbooks.model import load_playbook
    fleet, hosts, state = local
    pb = load_playbook(find_playbook("defrag-tier0", None))
    out = check_then_apply(fleet, hosts, pb, ApplyOptions(install=install, state_dir=state, **opts), lambda *a: None)
    [r] = out.results
    return out, r


def sha(path: Path) -> str:
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_apply_pass_writes_only_the_plan_it_was_shown(installs, local):
    """The apply pass is bound to the check pass's plans (HostPlan post-images): a file that
    changes between the plan shown and the write fails the host, and nothing is written."""
    from fleetctl.engine.playbooks.apply import ApplyOptions, check_then_apply
    from fleetctl.engine.playbooks.model import load_playbook
    from fleetctl.paths import find_playbook
    fleet, hosts, state = local
    checkout = installs["checkout"]
    runner = checkout / RUNNER
    original = runner.read_bytes()
    meanwhile = original + b"# edited between the plan and the write\n"

    def confirm(results, to_change):
        assert [r.status for r in results] == ["changed"]
        runner.write_bytes(meanwhile)

    pb = load_playbook(find_playbook("defrag-tier0", None))
    try:
        out = check_then_apply(fleet, hosts, pb, ApplyOptions(install=f"host:{checkout / 'sglang'}",
                                                                state_dir=state), confirm)
        [r] = out.results
        assert r.status == "failed"
        assert r.error.startswith("the plan for this host changed after it was shown and confirmed"), r.error
        assert runner.read_bytes() == meanwhile
    finally:
        runner.write_bytes(original)


def test_apply_status_rollback_on_a_git_checkout(installs, local):
    """The change lands in the checkout (not site-packages); status judges drift there against
    the ledger and git (run as the tree's owner, the repository's fsmonitor never run);
    rollback --last --install gives the original bytes back."""
    from fleetctl.engine.ledger import rollback_job, status_job
    fleet, hosts, state = local
    checkout = installs["checkout"]
    runner, alloc = checkout / RUNNER, checkout / "sglang/srt/mem_cache/allocator.py"
    before = sha(runner)
    iid = f"host:{checkout / 'sglang'}"
    marker = checkout.parent / ".git" / "fsmonitor-ran"  # a place the owner may write
    subprocess.run(["runuser", "-u", "nobody", "--", "git", "-C", str(checkout.parent), "config",
                    "core.fsmonitor", f"touch {marker}"], check=True)
    out, r = apply_to(local, iid)
    assert (r.status, r.error) == ("changed", None), r.data.get("plan")
    assert [f["path"] for f in r.data["plan"]["files"]] == [str(runner)]
    line5 = runner.read_text().splitlines()[4]
    assert line5.startswith("    need_sort = True") and "fleetctl defrag-tier0:" in line5
    assert os.stat(runner).st_uid == os.stat(checkout).st_uid  # owner kept
    [st] = fleet.run(hosts, status_job(state, install=iid))
    assert (st.status, st.error) == ("ok", None)
    [inst] = st.data["installs"]
    assert (inst["install"], inst["git"], inst["modified"]) == ("editable", str(checkout.parent), [])
    assert [c["install"] for c in st.data["changes"]] == [iid]
    alloc.write_text(alloc.read_text() + "# hand edit\n")
    try:
        [st] = fleet.run(hosts, status_job(state, install=iid))
        assert not marker.exists()  # the repository's fsmonitor never ran (nor before, above)
    finally:
        subprocess.run(["runuser", "-u", "nobody", "--", "git", "-c", "core.fsmonitor=false", "-C",
                        str(checkout.parent), "checkout", "-q",
                        "--", str(alloc)], check=True)
    assert st.status == "failed" and st.data["modified"] == [
        {"path": str(alloc), "problem": "modified outside fleetctl (git)"}]
    [rb] = fleet.run(hosts, rollback_job(None, False, state, install=iid))
    assert rb.status == "changed" and rb.data["files"]
    assert sha(runner) == before


def test_apply_says_the_package_directory_was_not_found_not_no_need_sort(installs, local):
    checkout = installs["checkout"]
    moved = checkout.with_name("python-moved")
    checkout.rename(moved)
    try:
        _, r = apply_to(local, None, check=True)
    finally:
        moved.rename(checkout)
    assert r.status == "failed" and "sglang package directory not found under" in r.error
    assert "need_sort" not in r.error


def test_apply_and_rollback_on_a_wheel_install_by_id(installs, local):
    fleet, hosts, state = local
    sp = Path(site_packages(installs["env"]))
    runner = sp / RUNNER
    before = sha(runner)
    # the inventory's interpreter sees the editable install; the wheel one is not on this host
    # for it, and naming it is an error that names the installs there
    _, r = apply_to(local, f"host:{sp}/sglang")
    assert r.status == "failed" and f"no install host:{sp}/sglang" in r.error
    assert f"host:{installs['checkout'] / 'sglang'}" in r.error and sha(runner) == before


def test_export_patch_for_a_checkout_names_what_it_was_checked_against(installs, local, tmp_path):
    """Pre-images equal to the release wheel (--pristine-dir): `<playbook>-sglang-<version>.patch`
    checked against that wheel; after a local commit changes a pre-image: a `-<hash8>` name,
    checked against what fleetctl read. Either applies with patch -p1 where it says."""
    from fleetctl.engine.playbooks.patches import write_patches
    checkout = installs["checkout"]
    iid = f"host:{checkout / 'sglang'}"
    runner = checkout / RUNNER
    _, r = apply_to(local, iid, check=True, export=True)
    assert r.status == "changed" and r.data["install_sglang"][iid]["version"] == "0.5.5"
    [p1] = write_patches([r], "defrag-tier0", tmp_path / "a", installs["wheels"])
    wheel = next(installs["wheels"].glob("sglang-0.5.5-*.whl"))
    assert p1.name == "defrag-tier0-sglang-0.5.5.patch"
    assert f"{wheel.name} sha256 {sha(wheel)}" in p1.read_text()
    original = runner.read_bytes()
    runner.write_bytes(b"# local change\n" + original)
    try:
        _, r2 = apply_to(local, iid, check=True, export=True)
        [p2] = write_patches([r2], "defrag-tier0", tmp_path / "b", installs["wheels"])
        copy = tmp_path / "copy"
        (copy / RUNNER).parent.mkdir(parents=True)
        (copy / RUNNER).write_bytes(runner.read_bytes())
        patched = subprocess.run(["patch", "-p1", "--batch", "-d", str(copy)], stdin=p2.open(), capture_output=True)
    finally:
        runner.write_bytes(original)
    assert p2.name.startswith("defrag-tier0-sglang-0.5.5-") and p2.name != p1.name
    assert "the pre-images fleetctl read on the host (they differ from the release wheel)" in p2.read_text()
    assert patched.returncode == 0, patched.stdout
    [f] = r2.data["plan"]["files"]
    assert sha(copy / RUNNER) == f["post_sha256"]
    assert p2.read_text().count("--- a/sglang/srt/model_executor/model_runner.py") == 1
