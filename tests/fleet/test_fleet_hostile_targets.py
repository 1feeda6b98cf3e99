"""Review N6 through real sshd: the inventory's API key goes only to a server fleetctl identified,
on that server's own listening socket. Fake servers a local user (`nobody`) starts, whose argv
claims ports and addresses they do not own, are refused by name and never sent a request; the
real stand-in still passes; the key appears nowhere in fleetctl's output."""

from __future__ import annotations

import secrets

import yaml

HOST = "lab-01"
FAKES = "/tmp/fleetctl-n6"  # the lab host's private /tmp
RECORDER_PORT = 39997  # a loopback listener of nobody's that is no server: it keeps what it gets
OFFHOST_PORT = 39996


def offhost(lab) -> tuple[str, int]:
    """An address of the lab's own subnet that no lab host has (.250): not the host's, and in a
    network the project made itself, so nothing would leave it even if fleetctl connected."""
    return lab.address(HOST).rsplit(".", 1)[0] + ".250", OFFHOST_PORT

# `python3 -m sglang.launch_server` from FAKES: a process that looks like an SGLang server. With
# --freebind it listens on its --host:--port even where that is no address of this host
# (IP_FREEBIND needs no privilege) and keeps what it gets; else it listens on nothing.
FAKE_SERVER = """\
import socket, sys, time
args = sys.argv[1:]
if "--freebind" in args:
    host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
    s = socket.socket()
    s.setsockopt(socket.IPPROTO_IP, 15, 1)  # IP_FREEBIND
    s.bind((host, port))
    s.listen()
    while True:
        c, _ = s.accept()
        with open("got-%d" % port, "ab") as f:
            f.write(c.recv(65536))
        c.close()
time.sleep(3600)
"""
# A plain loopback listener (no server): keeps every request's bytes and answers 200 {}.
RECORDER = """\
import socket, sys
port = int(sys.argv[1])
s = socket.socket()
s.bind(("127.0.0.1", port))
s.listen()
while True:
    c, _ = s.accept()
    with open("got-%d" % port, "ab") as f:
        f.write(c.recv(65536))
    c.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\n{}")
    c.close()
"""
AS_NOBODY = "setsid setpriv --reuid=65534 --regid=65534 --clear-groups /usr/bin/python3"


def plant(server_lab) -> dict[str, int]:
    """Start, as nobody in FAKES, the recorder and three fake servers; {name: pid}."""
    off = offhost(server_lab)
    starts = {
        "recorder": f"{FAKES}/recorder.py {RECORDER_PORT}",
        "claims-standin-port": "-m sglang.launch_server --host 127.0.0.1 --port 30000",
        "claims-recorder-port": f"-m sglang.launch_server --host 127.0.0.1 --port {RECORDER_PORT}",
        "off-host": f"-m sglang.launch_server --host {off[0]} --port {off[1]} --freebind",
    }
    cmd = (f"rm -rf {FAKES} && mkdir -p {FAKES}/sglang && cd {FAKES} && : > sglang/__init__.py && "
           f"cat > sglang/launch_server.py <<'EOF'\n{FAKE_SERVER}EOF\n"
           f"cat > recorder.py <<'EOF'\n{RECORDER}EOF\n"
           f"chown -R 65534:65534 {FAKES} && "
           + " && ".join(f"{{ {AS_NOBODY} {argv} >/dev/null 2>&1 </dev/null & echo {name} $! >> pids; }}"
                         for name, argv in starts.items())
           + " && sleep 1 && cat pids")
    r = server_lab.ssh(HOST, cmd)
    assert r.returncode == 0, r.stderr
    pids = {name: int(pid) for name, pid in (line.split() for line in r.stdout.split("\n") if line)}
    alive = server_lab.ssh(HOST, " && ".join(f"test -d /proc/{p}" for p in pids.values()))
    assert alive.returncode == 0, "a fake died at start"
    return pids


def received(server_lab) -> str:
    """Every byte the recorder and the off-host fake were sent."""
    r = server_lab.ssh(HOST, f"cat {FAKES}/got-* 2>/dev/null || true")
    assert r.returncode == 0, r.stderr
    return r.stdout


def inventory(server_lab, tmp_path, name: str, key: str, **host_vars) -> str:
    """The server lab's inventory with `key` as HOST's fleetctl_sglang_api_key and `host_vars`
    (a None value removes the var)."""
    doc = yaml.safe_load(server_lab.inventory.read_text())
    h = doc["all"]["children"]["lab"]["hosts"][HOST]
    h["fleetctl_sglang_api_key"] = key
    for k, v in host_vars.items():
        if v is None:
            h.pop(k, None)
        else:
            h[k] = v
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_the_key_goes_only_to_the_identified_servers_own_socket(server_lab, tmp_path):
    """The stand-in runs with --api-key (it answers 401 without the key, so its pass proves the
    key reached it). Three fakes run as nobody: one claims the stand-in's port 30000, one the
    port nobody's recorder listens on, one an address that is not the host's (and listens there
    with IP_FREEBIND). Discovered (no fleetctl_sglang_port), with the lab's port 30000, and with
    the recorder's port in the inventory: the stand-in passes where it is named, each fake is
    refused with its pid, claimed port and reason (its owner first: issue 48, review R4-4; the
    socket rule behind it is tests/unit/test_targets.py's), the recorder and the off-host listener
    get no byte, and the key is in no output of fleetctl's."""
    key = "sk-fleetctl-n6-" + secrets.token_hex(12)
    r = server_lab.ssh(HOST, f"/opt/fleetctl-standin/restart.sh --api-key {key} && "
                             "cat /opt/fleetctl-standin/server.pid")
    assert r.returncode == 0, r.stderr
    standin = int(r.stdout.split()[-1])
    try:
        pids = plant(server_lab)
        found = inventory(server_lab, tmp_path, "discovered", key, fleetctl_sglang_port=None)
        named = inventory(server_lab, tmp_path, "named", key)  # the lab's fleetctl_sglang_port 30000
        wrong = inventory(server_lab, tmp_path, "wrong", key, fleetctl_sglang_port=RECORDER_PORT)
        outputs = []

        def validate(inv, rc):
            p, _, hosts = server_lab.cli_json("validate", HOST, "-i", inv, "--repeat", "1", "--health-timeout", "20")
            outputs.append(p.stdout + p.stderr)
            assert received(server_lab) == ""  # first: nothing reached nobody's listeners
            assert p.returncode == rc, (p.returncode, hosts[HOST]["status"], hosts[HOST]["error"])
            return hosts[HOST]

        def owner(pid):  # issue 48 (review R4-4): a server is identified by its owner first
            return ("pid %d runs as uid 65534: not root, not the owner of its interpreter's environment (uid 0), and "
                    "in no system service: not a server of this host's (fleetctl sends it nothing; name the servers' "
                    "account in fleetctl_server_user)" % pid)
        off = offhost(server_lab)
        fakes = sorted([
            {"pid": pids["claims-standin-port"], "host": "127.0.0.1", "port": 30000},
            {"pid": pids["claims-recorder-port"], "host": "127.0.0.1", "port": RECORDER_PORT},
            {"pid": pids["off-host"], "host": off[0], "port": off[1]}], key=lambda x: x["pid"])
        refused = [dict(f, reason=owner(f["pid"])) for f in fakes]

        h = validate(found, 0)
        assert (h["status"], h["error"]) == ("ok", None)
        decoded = [(s["pid"], s["host"], s["port"], s["ok"]) for s in h["servers"]]
        assert decoded == [(standin, "127.0.0.1", 30000, True)]
        assert sorted(h["refused"], key=lambda x: x["pid"]) == refused

        h = validate(named, 0)
        assert [(s["pid"], s["port"], s["ok"]) for s in h["servers"]] == [(standin, 30000, True)]
        assert sorted(h["refused"], key=lambda x: x["pid"]) == refused

        h = validate(wrong, 2)  # no target left: failed with the reasons, nothing sent
        assert (h["status"], h["servers"]) == ("failed", [])
        assert h["error"].startswith("no server to smoke-test (nothing sent): "), h["error"]
        assert ("fleetctl_sglang_port %d: 127.0.0.1:%d is the listener of a process that is no identified server"
                % (RECORDER_PORT, RECORDER_PORT)) in h["error"]
        assert all(owner(f["pid"]) in h["error"] for f in fakes), h["error"]

        text = server_lab.cli("validate", HOST, "-i", found, "--repeat", "1", "--health-timeout", "20",
                              env={"COLUMNS": "400"})
        assert text.returncode == 0, text.stdout[-2000:]
        outputs.append(text.stdout + text.stderr)
        assert received(server_lab) == ""
        for out in outputs:
            assert key not in out
    finally:
        server_lab.ssh(HOST, f"[ -f {FAKES}/pids ] && kill $(cut -d' ' -f2 {FAKES}/pids); rm -rf {FAKES}")
        server_lab.set_behavior(HOST, {}, restart=True)
