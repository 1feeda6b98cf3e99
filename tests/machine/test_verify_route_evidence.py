"""The routing evidence of route-verify-attention's hook (playbooks/templates/route-verify-attention/
fleetctl_verify.py.j2): STATE_DIR/route-evidence/<pid>.json, written by atomic replace when a
CUDA-graph capture routes a new shape, every _EVIDENCE_EVERY eager routed calls, at a fallback
reason's first call and at exit. The hook rendered and imported over the run's real CPU build as
test_verify_route_hook does (its fixture and helpers); a capture is simulated by monkeypatching
torch.cuda's capture query (a CPU process never captures). Root: the hook trusts root-owned builds only."""

from __future__ import annotations

import inspect
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

from test_verify_route_hook import call_args, hook, pytestmark, render, routed_args, state  # noqa: F401

SINKS = torch.zeros(8)


def evidence_dir(link: Path) -> Path:
    return link.parents[2] / "route-evidence"  # STATE_DIR/kernels/verify_attention/current


def read(link: Path, pid: int = os.getpid()) -> dict:
    return json.loads((evidence_dir(link) / f"{pid}.json").read_text())


def every(fwd) -> int:
    """The hook's _EVIDENCE_EVERY (its module's, under torch.compiler.disable's wrapper)."""
    return inspect.unwrap(fwd).__globals__["_EVIDENCE_EVERY"]


def start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])


def test_eager_calls_are_written_every_n_and_fallbacks_by_reason(tmp_path, state):
    fwd = hook(tmp_path, state)
    n = every(fwd)
    kw, _ = routed_args(0)  # B 2, T 1, G 1
    path = evidence_dir(state) / f"{os.getpid()}.json"
    umask = os.umask(0o077)
    try:
        for _ in range(n - 1):
            assert fwd(**kw) is True
        assert not path.parent.exists()  # nothing written before the N-th eager routed call
        assert fwd(**kw) is True
    finally:
        os.umask(umask)
    assert oct(path.parent.stat().st_mode & 0o7777) == "0o755" and oct(path.stat().st_mode & 0o7777) == "0o644"
    got = read(state)
    assert {k: got[k] for k in ("pid", "start_time", "build", "module", "captured", "eager_routed", "fallbacks",
                                "trigger")} == {
        "pid": os.getpid(), "start_time": start_time(os.getpid()), "build": str(state.parent / "k1"),
        "module": (state.parent / "k1" / "PASSED").read_text().strip(), "captured": [], "eager_routed": n,
        "fallbacks": {}, "trigger": "eager"}
    held = tmp_path / "held"
    os.link(path, held)  # the record as it was: a replace leaves this inode alone
    for _ in range(n):
        fwd(**kw)
    assert read(state)["eager_routed"] == 2 * n
    assert json.loads(held.read_text())["eager_routed"] == n and held.stat().st_ino != path.stat().st_ino
    # each fallback reason written at its first call, counted at every call
    other, _ = call_args(2, 2, [3, 1], 1, torch.float32)    # T 2: no dispatch entry
    five, _ = call_args(5, 1, [1] * 5, 1, torch.float32)    # max_batch 4
    fallbacks = [dict(kw, sinks=SINKS), dict(kw, sinks=SINKS), dict(kw, is_causal=False), dict(kw, mystery=1),
                 other, five, dict(kw, max_len_extend=4)]
    for i, call in enumerate(fallbacks):
        assert fwd(**call) is False
        if i == 1:  # a reason's second call: not written
            assert read(state)["fallbacks"] == {"keyword sinks": 1}
    assert read(state)["fallbacks"] == {"keyword sinks": 2, "not causal": 1, "keyword mystery": 1,
                                        "shape not enabled": 1, "batch over max_batch": 1, "uneven draft widths": 1}
    assert read(state)["trigger"] == "fallback" and read(state)["eager_routed"] == 2 * n
    assert sorted(os.listdir(path.parent)) == [path.name]  # no temp file left


def test_a_capture_records_its_shapes_once_each(tmp_path, state, monkeypatch):
    fwd = hook(tmp_path, state)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    two, _ = routed_args(0)    # B 2, T 1, G 1
    three, _ = routed_args(2)  # B 3, T 4, G 1
    assert fwd(**two) is True and fwd(**three) is True
    path = evidence_dir(state) / f"{os.getpid()}.json"
    ino = path.stat().st_ino
    assert fwd(**two) is True
    assert path.stat().st_ino == ino  # a shape already captured: not written again
    got = read(state)
    assert got["captured"] == [{"batch": 2, "draft_tokens": 1, "head_dim": 64, "group": 1, "dtype": "float32"},
                               {"batch": 3, "draft_tokens": 4, "head_dim": 64, "group": 1, "dtype": "float32"}]
    assert got["eager_routed"] == 0 and got["trigger"] == "capture"


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
    n = every(hook(tmp_path, state))
    torch.save([kw] * (n + 3) + [dict(kw, sinks=SINKS)], tmp_path / "calls.pt")
    p = subprocess.Popen([sys.executable, "-c", EXITING, str(path), str(tmp_path / "calls.pt")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and out.strip() == str(n + 3), err
    got = read(state, p.pid)
    assert (got["pid"], got["eager_routed"], got["fallbacks"], got["trigger"]) == (
        p.pid, n + 3, {"keyword sinks": 1}, "exit")
    assert "fleetctl route-verify-attention" not in err  # nothing logged: no call went uncounted


def test_a_link_planted_at_the_record_its_temp_file_or_its_directory_is_never_followed(tmp_path, state, caplog,
                                                                                          monkeypatch):
    d = evidence_dir(state)
    d.mkdir(mode=0o755)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (d / f"{os.getpid()}.json").symlink_to(victim)
    fwd = hook(tmp_path, state)
    kw, _ = routed_args(0)
    assert fwd(**dict(kw, sinks=SINKS)) is False
    assert victim.read_text() == "keep" and not (d / f"{os.getpid()}.json").is_symlink()
    assert read(state)["fallbacks"] == {"keyword sinks": 1}
    # the temp name (made predictable here) planted as a link to a file that is not there
    monkeypatch.setattr(os, "urandom", lambda k: bytes(k))
    made = tmp_path / "made-through-the-link"
    (d / f".{os.getpid()}.json.{bytes(8).hex()}").symlink_to(made)
    with caplog.at_level(logging.WARNING, "fleetctl.verify"):
        assert fwd(**dict(kw, is_causal=False)) is False
    assert not made.exists() and "routing evidence not written" in caplog.text
    assert read(state)["fallbacks"] == {"keyword sinks": 1}
    monkeypatch.undo()
    # the directory a link, another user's, writable by others: refused, logged once, calls unharmed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    d.symlink_to(elsewhere)
    caplog.clear()
    fwd = hook(tmp_path, state)
    with caplog.at_level(logging.WARNING, "fleetctl.verify"):
        assert fwd(**dict(kw, sinks=SINKS)) is False and fwd(**dict(kw, is_causal=False)) is False
        assert fwd(**kw) is True
    assert list(elsewhere.iterdir()) == []
    assert caplog.text.count(f"routing evidence not written (tried again at each trigger): {d} is a symbolic link") == 1
    d.unlink()
    for change, said in ((lambda: (d.mkdir(mode=0o755), os.chown(d, 65534, 0)), "belongs to uid 65534"),
                         (lambda: (d.mkdir(), os.chmod(d, 0o757)), "is writable by group or others (mode 757)")):
        change()
        caplog.clear()
        fwd = hook(tmp_path, state)
        with caplog.at_level(logging.WARNING, "fleetctl.verify"):
            assert fwd(**dict(kw, sinks=SINKS)) is False
        assert said in caplog.text and list(d.iterdir()) == []
        d.rmdir()
