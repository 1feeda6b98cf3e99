"""No host code runs as root (issue 48; review round 4, R4-1 to R4-3): as root, on real trees,
each child that starts an install's interpreter or imports its packages runs as the account
probes/runas.py chooses, with no_new_privs and no capabilities; an install whose site module,
`.pth` directory and a dependency's editable finder record the uid they run as (helpers/
hostile_install.py) never records uid 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fleetctl import probes
from fleetctl.probes import runas
from helpers import hostile_install

NOBODY = hostile_install.NOBODY
SHOW = ("import json, os\n"
        "s = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)\n"
        "print(json.dumps({'uid': os.getresuid(), 'gid': os.getresgid(), 'groups': os.getgroups(),"
        " 'caps': [s[k].strip() for k in ('CapInh', 'CapPrm', 'CapEff', 'CapAmb')], 'nnp': s['NoNewPrivs'].strip()}))\n")


@pytest.fixture
def top():
    d = Path(tempfile.mkdtemp(prefix="fc-unpriv-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    subprocess.run(["rm", "-rf", "--one-file-system", str(d)], check=True)


def test_the_child_holds_the_accounts_ids_no_capability_and_no_new_privs():
    acct = runas.account()
    assert (acct.uid, acct.why) == (NOBODY, "the unprivileged account nobody")
    r = runas.run(["/usr/bin/python3", "-I", "-S", "-c", SHOW], acct, timeout=30)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["uid"] == [NOBODY] * 3 and got["gid"] == [acct.gid] * 3 and set(got["groups"]) <= {acct.gid}
    assert got["caps"] == ["0000000000000000"] * 4 and got["nnp"] == "1"


def test_the_account_is_the_servers_effective_uid_else_the_owners_else_nobody_never_root(top):
    # a server whose real uid is root and effective uid is not (a setuid launcher): its euid
    server = subprocess.Popen(["setpriv", f"--euid={NOBODY}", "sleep", "60"])
    try:
        deadline = __import__("time").monotonic() + 10
        while runas.ids_of(server.pid)[0] != NOBODY:
            assert __import__("time").monotonic() < deadline
        acct = runas.account([server.pid], "/", None)
        assert (acct.uid, acct.why) == (NOBODY, f"the effective uid of server pid {server.pid}")
    finally:
        server.kill()
        server.wait()
    # a root server: the tree's owner when that is not root
    tree = top / "tree"
    tree.mkdir()
    os.chown(tree, 4242, 4243)
    assert runas.account([os.getpid()], str(tree)) == runas.Account(4242, 4243, [4243], f"the owner of {tree}")
    os.chown(tree, 0, 0)
    assert runas.account([os.getpid()], str(tree)).why == "the unprivileged account nobody"
    assert runas.account((), str(tree), "nobody").why == "fleetctl_unprivileged_user nobody"
    with pytest.raises(runas.NoAccount, match="fleetctl_unprivileged_user root is root"):
        runas.account((), str(tree), "root")
    with pytest.raises(runas.NoAccount, match="fleetctl_unprivileged_user fc-no-such-user does not exist"):
        runas.account((), str(tree), "fc-no-such-user")
    with pytest.raises(runas.NoAccount, match="as root"):
        runas.spawn(["true"], runas.Account(0, 0, [], "x"), {})


def test_inspect_asks_the_install_as_nobody_and_its_site_code_never_runs_as_root(top):
    """R4-1 and R4-2 for the facts probe: a root-owned venv whose `.pth` names uid 65534's
    directory (its sitecustomize runs at every start) and maps numpy to 65534's checkout; the
    facts probe, as root, asks it as nobody: it is inspected, and every line its code wrote says
    a uid other than 0."""
    install = hostile_install.make(top)
    params = {"python": install["python"], "scan": False, "with_sources": False}
    r = hostile_install.in_root_view([sys.executable, "-c", probes.WRAPPER], input=probes.bundle("facts.host", params))
    out = probes.parse_output(r.stdout, r.stderr, r.returncode)
    lines = hostile_install.marks(install)
    assert lines and all(" uid 0 " not in line and not line.endswith(" euid 0") for line in lines), lines
    assert any(line.startswith("sitecustomize ") for line in lines) and any(line.startswith("numpy finder ") for line in lines)
    [inst] = [i for i in out["installs"] if i["python"]["path"] == install["python"]]
    assert inst["sglang"]["version"] == "0.5.23" and inst["sglang"]["package_dir"] == install["tree"]
    assert inst["asked_as"] == {"uid": NOBODY, "why": "the unprivileged account nobody"}


def test_the_allocator_replay_imports_the_install_as_nobody(top):
    """R4-3: `inspect --allocator-replay`'s child imports the install's torch (here a stand-in
    that imports numpy through 65534's finder): as nobody, and the replay says so."""
    install = hostile_install.make(top)
    site = Path(install["site"])
    params = {"package_dir": install["tree"], "location": str(site), "trace": {"pool": 65536, "requests": 20},
              "servers": [], "deadline_s": 60}
    r = hostile_install.in_root_view([install["python"], "-I", "-S", "-c", probes.WRAPPER],
                                     input=probes.bundle("traffic.allocreplay", params))
    out = probes.parse_output(r.stdout, r.stderr, r.returncode)
    assert out["ran_as"] == {"uid": NOBODY, "why": "the unprivileged account nobody"}, out
    lines = hostile_install.marks(install)
    assert {line.split(" uid ")[0] for line in lines} >= {"sitecustomize", "numpy finder", "torch", "numpy"}, lines
    assert all(line.endswith(f"uid {NOBODY} euid {NOBODY}") for line in lines), lines


def test_every_kernel_action_runs_the_installs_code_as_nobody(top):
    """R4-1 and R4-2 for kbuild (every action, `deploy --check`'s preflight included) and the
    dispatch measurement: the probe runs as root with `-I -S` (no site) and each child that
    starts the interpreter with its site or imports torch runs as nobody."""
    install = hostile_install.make(top)
    src = top / "pkg"
    src.mkdir()
    (src / "test_kernel.py").write_text("import torch\n")
    (src / "bench.py").write_text("import torch, json\nprint(json.dumps({'ok': True}))\n")
    (src / "k.cpp").write_text("int k() { return 0; }\n")
    built = top / "built"
    built.mkdir()
    (built / "m.so").write_bytes(b"\x7fELF")
    src.chmod(0o755)

    def kbuild(main, **params):
        r = hostile_install.in_root_view([install["python"], "-I", "-S", "-c", probes.WRAPPER],
                                         input=probes.bundle(main, params))
        return probes.parse_output(r.stdout, r.stderr, r.returncode)

    pre = kbuild("kernel.kbuild", action="preflight", backends=["cpu"])
    assert pre["ran_as"]["uid"] == NOBODY and pre["facts"]["torch"]["version"] == "2.13.0", pre
    b = kbuild("kernel.kbuild", action="build", src_dir=str(src), build_dir=str(top / "b"), name="k",
               sources=["k.cpp"], deadline_s=60, cache_dir=str(top / "ccache"))
    assert not b["ok"] and b["ran_as"]["uid"] == NOBODY, b  # the stand-in torch has no cpp_extension
    t = kbuild("kernel.kbuild", action="test", src_dir=str(src), module_path=str(built / "m.so"), test="test_kernel.py",
               reference="r.py:f", tolerances={}, device="cpu", deadline_s=60)
    assert t["ran_as"]["uid"] == NOBODY and t["rc"] == 0, t
    d = kbuild("kernel.dispatchbench", src_dir=str(src), script="bench.py", request={}, deadline_s=60)
    assert d["ok"] and d["ran_as"]["uid"] == NOBODY, d
    lines = hostile_install.marks(install)
    assert {line.split(" uid ")[0] for line in lines} >= {"sitecustomize", "numpy finder", "torch", "numpy"}, lines
    assert all(line.endswith(f"uid {NOBODY} euid {NOBODY}") for line in lines), lines


def test_config_json_is_read_as_the_servers_uid(top):
    """R4-7: the dispatch measurement reads a server's config.json as that server's uid: a file
    only root may read is not read for a nobody server (no existence oracle for its owner)."""
    from fleetctl.probes.traffic import serverinfo
    model = top / "model"
    model.mkdir(mode=0o755)
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 32, "torch_dtype": "bfloat16"}))
    (model / "config.json").chmod(0o600)
    server = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sleep", "60"])
    try:
        deadline = __import__("time").monotonic() + 10
        while (runas.ids_of(server.pid) or (None,))[0] != NOBODY:
            assert __import__("time").monotonic() < deadline
        config, why = serverinfo.read_config(str(model), server.pid)
        assert config is None and why.startswith("config.json not readable as the server's uid")
        (model / "config.json").chmod(0o644)
        config, why = serverinfo.read_config(str(model), server.pid)
        assert why is None and config["num_attention_heads"] == 32
    finally:
        server.kill()
        server.wait()


SERVER = '''import http.server, json, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"model_path": "/nonexistent/model", "max_total_num_tokens": 4096}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def test_a_root_servers_load_client_imports_the_install_as_nobody(top):
    """R4-3 for `validate --load`: a root server (a STAND-IN launch_server answering /health,
    /server_info and /model_info) of the hostile install; its load client, the install's own
    bench_serving (a stand-in that imports torch), runs as nobody: every line says so."""
    from helpers.proc import free_port
    install = hostile_install.make(top)
    pkg = Path(install["tree"])
    (pkg / "launch_server.py").write_text(SERVER)
    flags = ("backend", "host", "port", "model", "tokenizer", "dataset-name", "num-prompts", "random-input-len",
             "random-output-len", "random-range-ratio", "request-rate", "max-concurrency", "seed", "warmup-requests",
             "flush-cache", "disable-tqdm", "output-details", "output-file")
    (pkg / "bench_serving.py").write_text("import torch\nimport sys\n" + "".join(
        f'# parser.add_argument("--{f}")\n' for f in flags) + "sys.exit(1)\n")  # SGLang's client's flags, by name
    port = free_port()
    server = subprocess.Popen([install["python"], "-m", "sglang.launch_server", "--port", str(port), "--host",
                               "127.0.0.1"], cwd="/")
    try:
        import socket
        import time
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.1)
        sel = {"pid": server.pid, "python": install["python"], "port": port, "host": "127.0.0.1",
               "package_dir": str(pkg), "version": "0.5.23"}
        r = hostile_install.in_root_view([sys.executable, "-c", probes.WRAPPER],
                                         input=probes.bundle("traffic.load", {"servers": [sel], "timeout": 60,
                                                                              "health_timeout": 10}))
        out = probes.parse_output(r.stdout, r.stderr, r.returncode)
    finally:
        server.kill()
        server.wait()
    [s] = out["servers"]
    assert s["ran_as"] == {"uid": NOBODY, "why": "the unprivileged account nobody"}, s
    assert s["client"] == "sglang.bench_serving" and s["returncode"] == 1, json.dumps(s)  # it ran (the stand-in exits 1)
    lines = hostile_install.marks(install)  # the root server's own (its site ran as root: its doing), the client's
    client = [line for line in lines if line.startswith("torch ")]  # only the client imports torch
    assert client and all(line.endswith(f"uid {NOBODY} euid {NOBODY}") for line in client), lines
    assert f"sitecustomize uid {NOBODY} euid {NOBODY}" in lines, lines
