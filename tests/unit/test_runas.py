"""probes/runas.py as the unit room runs it (an unprivileged uid, so the child keeps this uid):
the child's environment built from nothing, no_new_privs, its own process group killed at the
deadline and at its end, bounded output, and its private directory removed whatever it left
(tests/machine/test_runas_root.py: the drop itself, as root)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from fleetctl.probes import runas, safefs
from helpers.proc import gone

SHOW = ("import json, os, sys\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines() if ':' in l)\n"
        "print(json.dumps({'env': dict(os.environ), 'nnp': status['NoNewPrivs'].strip(), 'fds': sorted(os.listdir('/proc/self/fd')),"
        " 'sid': os.getsid(0), 'pid': os.getpid(), 'pgid': os.getpgid(0), 'cwd': os.getcwd(), 'stdin': sys.stdin.read()}))\n")


@pytest.fixture
def me():
    if os.geteuid() == 0:
        pytest.skip("the unit room runs unprivileged (tests/machine/test_runas_root.py covers root)")
    return runas.account()


def test_an_unprivileged_fleetctl_runs_the_child_as_itself(me):
    assert (me.uid, me.gid, me.why) == (os.geteuid(), os.getegid(), "fleetctl's own uid (not root)")
    assert runas.account([os.getpid()], "/", "someone") == me  # nothing to choose: it cannot drop


def test_the_child_gets_an_environment_from_nothing_no_new_privs_and_its_own_group(me, monkeypatch):
    import json
    monkeypatch.setenv("TRITON_HOME", "/home/someone/.triton")
    monkeypatch.setenv("CC", "/home/someone/bin/cc")
    r = runas.run([sys.executable, "-I", "-S", "-c", SHOW], me, b"x" * 300000, timeout=30, extra_env={"K": "v"})
    assert (r.returncode, r.timed_out, r.overflow) == (0, False, False), r.stderr
    got = json.loads(r.stdout)
    home = got["env"]["HOME"]
    assert got["env"] == {"PATH": runas.SYSTEM_PATH, "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
                          "TRITON_CACHE_DIR": os.path.join(home, "triton"), "K": "v"}
    assert home.startswith(runas.PRIVATE_PARENT + "/fleetctl-child-") and not os.path.lexists(home)  # removed after
    assert got["nnp"] == "1" and got["sid"] == got["pid"] == got["pgid"] and got["cwd"] == "/"
    assert len(got["fds"]) == 4  # 0, 1, 2 and the one listdir opened: no fd of this process leaked
    assert got["stdin"] == "x" * 300000  # a stdin larger than a pipe's buffer is written whole


def test_the_deadline_kills_the_whole_group_and_what_the_child_left_is_killed_at_its_end(me, tmp_path):
    t0 = time.monotonic()
    r = runas.run(["sh", "-c", "sleep 60 & echo $!; wait"], me, timeout=1)
    assert r.timed_out and time.monotonic() - t0 < 5
    left = int(r.stdout)
    assert gone(left)  # killed: gone as soon as the kernel runs it (CI of 2026-12-07 looked at once, under load)
    r = runas.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], me, timeout=10)  # exits at once, leaves one
    assert (r.returncode, r.timed_out) == (0, False)
    assert gone(int(r.stdout))


def test_output_past_the_bound_stops_the_child(me):
    r = runas.run(["sh", "-c", "yes"], me, timeout=30, limit=1 << 16)
    assert r.overflow and len(r.stdout) == 1 << 16 and r.returncode == -9


def test_the_private_directory_goes_however_deep_the_child_made_it(me):
    deep = "/".join(["d"] * 3000)  # deeper than Python's recursion limit
    r = runas.run(["sh", "-c", f'cd "$HOME" && mkdir -p {deep} && ln -s / root && echo "$HOME"'], me, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not os.path.lexists(r.stdout.decode().strip())


def test_rmtree_never_follows_a_link_and_stops_at_its_bound(tmp_path):
    """safefs.rmtree (runas.remove's): a link inside is removed, not followed; past its bound it
    stops and says so (review R4-5: a deep or huge tree made by another user)."""
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "f").write_text("x")
    tree = tmp_path / "tree"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "link").symlink_to(keep)
    for i in range(5):
        (tree / f"f{i}").write_text("")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(safefs.UnsafePath, match="more than 3 entries"):
            safefs.rmtree(fd, "tree", limit=3)
        safefs.rmtree(fd, "tree")
        with pytest.raises(FileNotFoundError):
            safefs.rmtree(fd, "tree")
    finally:
        os.close(fd)
    assert not tree.exists() and (keep / "f").read_text() == "x"


def test_ids_of_reads_the_effective_ids():
    uid, gid, groups = runas.ids_of(os.getpid())
    assert (uid, gid) == (os.geteuid(), os.getegid()) and set(groups) == set(os.getgroups())
    assert runas.ids_of(2 ** 22 + 1) is None

