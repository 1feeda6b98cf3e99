"""The routing evidence of route-verify-attention's hook (playbooks/templates/route-verify-attention/
fleetctl_verify.py.j2): PUBLIC/route-evidence/<euid>/<pid>.json, written by atomic replace by a
daemon thread within _EVIDENCE_S of a routed or fallen-back call (so the route gate's reader,
waiting routecheck.FLUSH_WAIT_S after its last request, sees every call), at once by a capture
that routes a new shape, and at exit; a forked child keeps its own record. The hook rendered and
imported over the run's real CPU build as test_verify_route_hook does (its fixture and helpers); a
capture is simulated by monkeypatching torch.cuda's capture query (a CPU process never captures).
Root: the hook trusts root-owned builds only."""

from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from fleetctl.probes.traffic.routecheck import FLUSH_WAIT_S
from test_verify_route_hook import call_args, hook, pytestmark, render, routed_args, state  # noqa: F401

SINKS = torch.zeros(8)


def evidence_dir(link: Path, uid: int = 0) -> Path:
    return link.parents[1] / "route-evidence" / str(uid)  # PUBLIC/verify_attention/current


def read(link: Path, pid: int = os.getpid()) -> dict:
    return json.loads((evidence_dir(link) / f"{pid}.json").read_text())


def flush_s(fwd) -> float:
    """The hook's _EVIDENCE_S (its module's, under torch.compiler.disable's wrapper)."""
    return inspect.unwrap(fwd).__globals__["_EVIDENCE_S"]


def start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])


def test_calls_are_written_within_the_flush_wait_and_fallbacks_by_reason(tmp_path, state):
    fwd = hook(tmp_path, state)
    assert flush_s(fwd) * 2 < FLUSH_WAIT_S  # the reader's wait covers a write already under way and the next
    kw, _ = routed_args(0)  # B 2, T 1, G 1
    path = evidence_dir(state) / f"{os.getpid()}.json"
    assert not path.parent.exists()  # nothing before the first call
    umask = os.umask(0o077)
    try:
        for _ in range(5):
            assert fwd(**kw) is True
        time.sleep(FLUSH_WAIT_S)
    finally:
        os.umask(umask)
    assert oct(path.parent.stat().st_mode & 0o7777) == "0o755" and oct(path.stat().st_mode & 0o7777) == "0o644"
    got = read(state)
    assert {k: got[k] for k in ("pid", "start_time", "uid", "build", "module", "captured", "eager_routed",
                                "fallbacks", "trigger")} == {
        "pid": os.getpid(), "start_time": start_time(os.getpid()), "uid": 0, "build": str(state.parent / "k1"),
        "module": (state.parent / "k1" / "PASSED").read_text().strip(), "captured": [], "eager_routed": 5,
        "fallbacks": {}, "trigger": "eager"}
    held = tmp_path / "held"
    os.link(path, held)  # the record as it was: a replace leaves this inode alone
    for _ in range(3):
        fwd(**kw)
    other, _ = call_args(2, 2, [3, 1], 1, torch.float32)    # T 2: no dispatch entry
    five, _ = call_args(5, 1, [1] * 5, 1, torch.float32)    # max_batch 4
    four, _ = call_args(4, 1, [1] * 4, 1, torch.float32)    # max_batch 4 itself: routed
    assert fwd(**four) is True
    for call in [dict(kw, sinks=SINKS), dict(kw, sinks=SINKS), dict(kw, is_causal=False), dict(kw, mystery=1),
                 other, five, dict(kw, max_len_extend=4)]:
        assert fwd(**call) is False
    time.sleep(FLUSH_WAIT_S)
    got = read(state)
    assert got["eager_routed"] == 9 and got["trigger"] == "fallback"
    assert got["fallbacks"] == {"keyword sinks": 2, "not causal": 1, "keyword mystery": 1, "shape not enabled": 1,
                                "batch over max_batch": 1, "uneven draft widths": 1}
    assert json.loads(held.read_text())["eager_routed"] == 5 and held.stat().st_ino != path.stat().st_ino
    assert sorted(os.listdir(path.parent)) == [path.name]  # no temp file left
    written = path.stat().st_mtime_ns
    time.sleep(FLUSH_WAIT_S)
    assert path.stat().st_mtime_ns == written  # nothing new: not written again


def test_a_capture_writes_a_new_shape_at_once(tmp_path, state, monkeypatch):
    fwd = hook(tmp_path, state)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    two, _ = routed_args(0)    # B 2, T 1, G 1
    three, _ = routed_args(2)  # B 3, T 4, G 1
    assert fwd(**two) is True and fwd(**three) is True and fwd(**two) is True
    got = read(state)  # no wait: the capturing call wrote it (a capture's end cannot be seen)
    assert got["captured"] == [{"batch": 2, "draft_tokens": 1, "head_dim": 64, "group": 1, "dtype": "float32"},
                               {"batch": 3, "draft_tokens": 4, "head_dim": 64, "group": 1, "dtype": "float32"}]
    assert got["eager_routed"] == 0 and got["trigger"] == "capture"


def test_a_forked_child_keeps_its_own_record(tmp_path, state):
    fwd = hook(tmp_path, state)
    kw, _ = routed_args(0)
    assert fwd(**kw) is True
    pid = os.fork()
    if pid == 0:  # the child: two fallbacks (no kernel run: CPU torch's thread pool is not fork-safe),
        try:     # its thread's write, no atexit
            fwd(**dict(kw, sinks=SINKS))
            fwd(**dict(kw, sinks=SINKS))
            time.sleep(FLUSH_WAIT_S)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(FLUSH_WAIT_S)
    child, parent = read(state, pid), read(state)
    assert (child["pid"], child["eager_routed"], child["fallbacks"]) == (pid, 0, {"keyword sinks": 2})
    assert (parent["pid"], parent["eager_routed"], parent["fallbacks"]) == (os.getpid(), 1, {})


# a server process: the hook's calls, then a normal exit; every torch.cuda entry that could
# initialise CUDA raises (on a CPU process the capture query must not even be asked)
EXITING = """
import importlib.util, sys, torch
def boom(*a, **k): raise AssertionError("CUDA touched")
for n in ("init", "_lazy_init", "is_current_stream_capturing", "current_device", "get_device_capability"):
    setattr(torch.cuda, n, boom)
spec = importlib.util.spec_from_file_location("fleetctl_verify", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
calls = torch.load(sys.argv[2])
print([m.verify_fwd(**kw) for kw in calls].count(True), flush=True)
"""


def test_the_exit_write_holds_every_call(tmp_path, state):
    path = tmp_path / "fleetctl_verify_exit.py"
    path.write_text(render(state))
    kw, _ = routed_args(1)  # B 2, T 4, G 8
    torch.save([kw] * 13 + [dict(kw, sinks=SINKS)], tmp_path / "calls.pt")
    p = subprocess.Popen([sys.executable, "-c", EXITING, str(path), str(tmp_path / "calls.pt")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and out.strip() == "13", err
    got = read(state, p.pid)
    assert (got["pid"], got["eager_routed"], got["fallbacks"], got["trigger"]) == (
        p.pid, 13, {"keyword sinks": 1}, "exit")
    assert "fleetctl route-verify-attention" not in err  # nothing logged: no call went uncounted


def _calls(fwd, kw, caplog):
    """Two fallbacks and a routed call, then the flush wait, logging captured: the calls unharmed."""
    with caplog.at_level(logging.WARNING, "fleetctl.verify"):
        assert fwd(**dict(kw, sinks=SINKS)) is False and fwd(**dict(kw, is_causal=False)) is False
        assert fwd(**kw) is True
        time.sleep(FLUSH_WAIT_S)


def test_a_link_planted_at_the_record_its_temp_file_or_its_directories_is_never_followed(
        tmp_path, state, caplog, monkeypatch):
    d = evidence_dir(state)
    d.mkdir(mode=0o755)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (d / f"{os.getpid()}.json").symlink_to(victim)
    fwd = hook(tmp_path, state)
    kw, _ = routed_args(0)
    assert fwd(**dict(kw, sinks=SINKS)) is False
    time.sleep(FLUSH_WAIT_S)
    assert victim.read_text() == "keep" and not (d / f"{os.getpid()}.json").is_symlink()
    assert read(state)["fallbacks"] == {"keyword sinks": 1}
    # the temp name (made predictable here) planted as a link to a file that is not there
    monkeypatch.setattr(os, "urandom", lambda k: bytes(k))
    made = tmp_path / "made-through-the-link"
    (d / f".{os.getpid()}.json.{bytes(8).hex()}").symlink_to(made)
    with caplog.at_level(logging.WARNING, "fleetctl.verify"):
        assert fwd(**dict(kw, is_causal=False)) is False
        time.sleep(FLUSH_WAIT_S)
    assert not made.exists() and "routing evidence not written" in caplog.text
    assert read(state)["fallbacks"] == {"keyword sinks": 1}
    monkeypatch.undo()
    # this uid's directory a link, another user's, writable by others: refused, logged once
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    d.symlink_to(elsewhere)
    caplog.clear()
    _calls(hook(tmp_path, state), kw, caplog)
    assert list(elsewhere.iterdir()) == []
    assert caplog.text.count(f"routing evidence not written (tried again at each write): {d} is a symbolic link") == 1
    d.unlink()
    for change, said in ((lambda: (d.mkdir(mode=0o755), os.chown(d, 65534, 0)), "belongs to uid 65534"),
                         (lambda: (d.mkdir(), os.chmod(d, 0o757)), "is writable by group or others (mode 757)"),
                         (lambda: (d.mkdir(), os.chmod(d, 0o775)), "is writable by group or others (mode 775)")):
        change()
        caplog.clear()
        _calls(hook(tmp_path, state), kw, caplog)
        assert said in caplog.text and list(d.iterdir()) == []
        d.rmdir()
    # PUBLIC/route-evidence itself: others may write it without the sticky bit, another user's, or a link
    top = d.parent
    os.chmod(top, 0o777)
    caplog.clear()
    _calls(hook(tmp_path, state), kw, caplog)
    assert "others may rename what is in it (uid 0, mode 777)" in caplog.text and not d.exists()
    os.chmod(top, 0o755)
    os.chown(top, 65534, 0)
    caplog.clear()
    _calls(hook(tmp_path, state), kw, caplog)
    assert "is not root's, or others may rename what is in it (uid 65534, mode 755)" in caplog.text and not d.exists()
    os.chown(top, 0, 0)
    os.chmod(top, 0o1777)
    top.rename(tmp_path / "top")
    top.symlink_to(tmp_path / "top")
    caplog.clear()
    _calls(hook(tmp_path, state), kw, caplog)
    assert "routing evidence not written" in caplog.text and list((tmp_path / "top").iterdir()) == []
