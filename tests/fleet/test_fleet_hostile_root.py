"""Nothing a host's other users choose runs as root (security review round 3, N1, N7, N10), over
real sshd on a lab host: a fake server in a mount namespace of its own (plain, under a user
namespace, with a forged delegated `docker-<id>.scope` cgroup, and as a system service) whose
argv[0] is a script that records every run: `inspect` never runs it, and a container is
entered only when its cgroup says it is one; an inventory interpreter under a directory
another user owns, or swapped between two runs, and a recorded interpreter whose directory
became writable by others, are refused on the start that would run them."""

from __future__ import annotations

import secrets
import shlex
import time

import pytest
import yaml

HOST = "lab-04"  # SGLang 0.5.23, no server of its own
NOBODY = 65534
# a fake SGLang server: what any local user can start (its package in the working directory)
FAKE_SERVER = "import time\ntime.sleep(600)\n"
# argv[0] of the fake server: records the uid of every run, then would hand over to Python
EVIL = "#!/bin/sh\nid -u >> {d}/ran\nexec /usr/bin/python3 \"$@\"\n"
# starts the fake server with EVIL as argv[0], in {d}, as it is launched by `prefix`
LAUNCH = ("import os; os.chdir({d!r}); os.execv('/usr/bin/python3', [{d!r} + '/evilpython', '-m', "
          "'sglang.launch_server', '--model-path', 'm', '--port', '39123'])")


def sh(lab, cmd: str, timeout: float = 60) -> str:
    r = lab.ssh(HOST, cmd, timeout=timeout)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


def inventory_with(lab, tmp_path, **host_vars) -> str:
    inv = yaml.safe_load(lab.inventory.read_text())
    inv["all"]["children"]["lab"]["hosts"][HOST].update(host_vars)
    path = tmp_path / f"hosts-{secrets.token_hex(3)}.yaml"
    path.write_text(yaml.safe_dump(inv))
    return str(path)


@pytest.fixture
def fake(lab):
    """A directory on the host with the fake server's package and EVIL (nobody's), and a
    starter: `start(prefix, cgroup=None)` runs LAUNCH under the shell words `prefix` in the
    background and returns its pid (the Python process), moved into `cgroup` (a path under
    /sys/fs/cgroup/unified, made for it) when given. Everything is killed and removed after."""
    d = f"/tmp/fc-n1-{secrets.token_hex(4)}"
    sh(lab, f"mkdir -p {d}/sglang && printf %s {shlex.quote(FAKE_SERVER)} > {d}/sglang/launch_server.py && "
            f": > {d}/sglang/__init__.py && printf %s {shlex.quote(EVIL.format(d=d))} > {d}/evilpython && "
            f"chmod 755 {d}/evilpython && chmod 777 {d} && chown -R {NOBODY}:{NOBODY} {d}")
    made: list[str] = []

    def start(prefix: str, cgroup: str | None = None) -> int:
        code = shlex.quote(LAUNCH.format(d=d))
        sh(lab, f"setsid {prefix} /usr/bin/python3 -c {code} </dev/null >/dev/null 2>&1 &")
        for _ in range(100):
            out = lab.ssh(HOST, f"pgrep -f -n '^{d}/evilpython -m sglang.launch_server'").stdout.strip()
            if out:
                break
            time.sleep(0.1)
        assert out, "the fake server did not start"
        pid = int(out)
        if cgroup:
            made.append(cgroup)
            sh(lab, f"mkdir -p {cgroup} && chown {NOBODY}:{NOBODY} {cgroup} && echo {pid} > {cgroup}/cgroup.procs")
        return pid

    yield d, start
    r = lab.ssh(HOST, "; ".join([f"pkill -9 -f '^{d}/evilpython'", "sleep 0.5", *(f"rmdir {c}" for c in reversed(made)),
                                 f"rm -rf {d}", f"! pgrep -f '^{d}/evilpython'"]))
    assert r.returncode == 0, (r.stdout, r.stderr)


def ran(lab, d: str) -> list[str]:
    return lab.ssh(HOST, f"cat {d}/ran 2>/dev/null").stdout.split()


def entry(hosts: dict, pid: int) -> dict:
    return next(c for c in hosts[HOST]["facts"]["containers"] if c["root"]["pid"] == pid)


DROP = f"setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups"


def test_a_fake_server_in_its_own_mount_namespace_is_never_entered_nor_run(lab, fake, tmp_path):
    """Review N1's reproduction: nobody's process in a private mount namespace (made by root, as
    systemd's sandboxing makes one), argv[0] a script of theirs. inspect lists it as no
    container's, with the reason, even when the inventory asks for nsenter; the script never
    runs. The same under a user namespace of nobody's own."""
    d, start = fake
    plain = start(f"unshare --mount --propagation private -- {DROP}")
    userns = start(f"{DROP} unshare --user --map-root-user --mount --")
    inv = inventory_with(lab, tmp_path, fleetctl_container_exec="nsenter")
    for args in ((), ("-i", inv)):
        r, _, hosts = lab.cli_json("inspect", HOST, *args, rc=0)
        for pid in (plain, userns):
            c = entry(hosts, pid)
            assert (c["kind"], c["entered_with"], c["error"]) == ("foreign", None, None), c
            cgroup = lab.ssh(HOST, f"grep '^0::' /proc/{pid}/cgroup").stdout.strip()[3:]
            assert c["note"] == f"not entered: pid {pid} is no container's: its cgroup ({cgroup}) names no container runtime"
            assert c["python"] == "/usr/bin/python3.11"  # /proc/PID/exe's name, never argv[0]
        assert not [i for i in hosts[HOST]["installs"] if not i["id"].startswith("host:")]
    assert ran(lab, d) == []


def test_a_forged_delegated_docker_scope_is_a_rootless_container_entered_only_as_its_user(lab, fake, tmp_path):
    """nobody's process in a cgroup named like Docker's (`docker-<64 hex>.scope`) that nobody
    owns, under user@65534.service (a subtree systemd delegates to that user): a rootless
    container of uid 65534, not entered by default; entered with nsenter only as nobody, with no
    capabilities: the fake server's own script never runs, at all."""
    d, start = fake
    cid = secrets.token_hex(32)
    cg = f"/sys/fs/cgroup/unified/user.slice/user-{NOBODY}.slice/user@{NOBODY}.service/docker-{cid}.scope"
    pid = start(f"unshare --mount --propagation private -- {DROP}", cgroup=cg)
    _, _, hosts = lab.cli_json("inspect", HOST, rc=0)
    c = entry(hosts, pid)
    assert (c["kind"], c["root"]["runtime"], c["root"]["container_id"], c["entered_with"]) == (
        "rootless", "docker", cid, None)
    assert c["note"].startswith(f"not entered: a rootless container of uid {NOBODY} (its cgroup ")
    assert c["note"].endswith("fleetctl_container_exec: nsenter enters it as that user")

    inv = inventory_with(lab, tmp_path, fleetctl_container_exec="nsenter")
    _, _, hosts = lab.cli_json("inspect", HOST, "-i", inv, rc=0)
    c = entry(hosts, pid)
    assert c["entered_with"] == "nsenter", c
    # what ran inside answered as nobody: the fake package found from the fake's working
    # directory, by the interpreter /proc/PID/exe names; its files are nobody's, so they count
    inside = [i for i in hosts[HOST]["installs"] if i["id"].startswith("docker:")]
    # and, as this fake container shares the host's files, the lab's own venv, whose interpreter
    # nobody may run (the lab host's /root is passable: lab/host.py root_binds)
    dirs = sorted(i["sglang"]["package_dir"] for i in inside)
    assert dirs == sorted([f"{d}/sglang", "/opt/sglang/venv/lib/python3.11/site-packages/sglang"]), hosts[HOST]["installs"]
    fake_install = next(i for i in inside if i["sglang"]["package_dir"] == f"{d}/sglang")
    assert fake_install["container"]["how"] == "nsenter" and "uid and gid" in fake_install["container"]["note"]
    assert ran(lab, d) == []


def test_a_system_service_in_its_own_mount_namespace_is_a_host_server(lab, fake):
    """A root process in its own mount namespace (PrivateTmp=) in the cgroup of a system service
    (/system.slice/NAME.service, root's): a host server, read through the host's trusted
    interpreter; its argv[0] script is not its interpreter and never runs."""
    d, start = fake
    cg = f"/sys/fs/cgroup/unified/system.slice/fc-n1-{secrets.token_hex(3)}.service"
    pid = start("unshare --mount --propagation private --", cgroup=cg)
    sh(lab, f"chown root:root {cg}")
    _, _, hosts = lab.cli_json("inspect", HOST, rc=None)
    server = next(s for s in hosts[HOST]["facts"]["servers"] if s["pid"] == pid)
    assert (server["python"], server["port"], server["cwd"]) == ("/usr/bin/python3.11", 39123, d)
    assert all(c["root"]["pid"] != pid for c in hosts[HOST]["facts"].get("containers", []))
    assert ran(lab, d) == []


@pytest.fixture
def venv(lab):
    """A root-owned venv of the host's /usr/bin/python3 under a fresh directory in /tmp; removed after."""
    top = f"/tmp/fc-n7-{secrets.token_hex(4)}"
    sh(lab, f"mkdir -m 755 {top} && /usr/bin/python3 -m venv --without-pip {top}/venv", timeout=120)
    yield top
    lab.ssh(HOST, f"rm -rf {top}")


def test_an_inventory_interpreter_under_another_users_directory_is_refused(lab, venv, tmp_path):
    """Review N7: the venv is root's, the directory above it nobody's (who can move the venv
    away and put theirs there): refused by the command that would start it, naming the
    directory, with one probe and no trust round trip."""
    py = f"{venv}/venv/bin/python"
    inv = inventory_with(lab, tmp_path, fleetctl_python=py)
    ok, _, hosts = lab.cli_json("inspect", HOST, "-i", inv, rc=0)
    assert hosts[HOST]["timing"]["probes"] == 1  # the trust probe's round trip is gone
    sh(lab, f"chown {NOBODY} {venv}")
    r, _, hosts = lab.cli_json("inspect", HOST, "-i", inv, rc=2)
    assert (hosts[HOST]["status"], hosts[HOST]["error"]) == (
        "failed", f"interpreter {py} refused: {venv} belongs to uid {NOBODY} (fleetctl runs it as root)")


def test_a_venv_swapped_between_two_runs_is_refused_on_the_second(lab, venv, tmp_path):
    """Review N7's swap: cleared on one run, the venv then renamed away by the owner of the
    directory above (here made nobody's after the first run) and replaced by their own
    `python`: the next run refuses it and it never runs."""
    py = f"{venv}/venv/bin/python"
    inv = inventory_with(lab, tmp_path, fleetctl_python=py)
    lab.cli_json("inspect", HOST, "-i", inv, rc=0)
    swap = (f"mv {venv}/venv {venv}/venv.old && mkdir -p {venv}/venv/bin && "
            f"printf '#!/bin/sh\\nid -u >> {venv}/ran\\nexec /usr/bin/python3 \"$@\"\\n' > {py} && chmod 755 {py}")
    sh(lab, f"chmod 777 {venv} && setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups sh -c {shlex.quote(swap)}")
    r, _, hosts = lab.cli_json("inspect", HOST, "-i", inv, rc=2)
    # the first thing the check finds: the directory that let nobody swap the venv
    assert hosts[HOST]["error"] == f"interpreter {py} refused: {venv} is writable by group or others (fleetctl runs it as root)"
    assert lab.ssh(HOST, f"test -e {venv}/ran").returncode != 0


def test_a_recorded_interpreter_is_checked_on_every_start(lab, venv):
    """Review N10: the interpreter record names a wrapper that was fine when recorded; its
    directory then becomes writable by a group. The next start refuses it, removes the record
    and runs python3 on PATH, which the facts probe records instead; the wrapper never runs again."""
    wrapper = f"{venv}/bin/python3"
    sh(lab, f"mkdir -m 755 {venv}/bin && printf '#!/bin/sh\\necho run >> {venv}/runs\\nexec /usr/bin/python3 \"$@\"\\n' "
            f"> {wrapper} && chmod 755 {wrapper}")
    record = "/var/lib/fleetctl/scan-cache/interpreter"
    lab.cli_json("inspect", HOST, rc=0)  # the cache directory exists
    saved = sh(lab, f"cat {record}")
    try:
        sh(lab, f"printf '%s\\n' {wrapper} > {record}")
        lab.cli_json("inspect", HOST, rc=0)
        assert sh(lab, f"cat {venv}/runs").split() == ["run"]  # started from the record
        sh(lab, f"printf '%s\\n' {wrapper} > {record} && chmod 775 {venv}/bin")
        lab.cli_json("inspect", HOST, rc=0)
        assert sh(lab, f"cat {venv}/runs").split() == ["run"]  # not again
        now = sh(lab, f"cat {record}").strip()
        assert now and now != wrapper
    finally:
        sh(lab, f"printf %s {shlex.quote(saved)} > {record}")
