"""Faults injected into and cleared from one lab host: a table of kinds (KINDS), each a small
function, behind lab_fault."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ..errors import UsageError
from .base import (PRIVATE_DIRS, VENV_PYTHONS, alive, find_host, host_dir, load, require_root, run, save,
                   state_dir_for, wait_banner)
from .host import start_sshd

HANG_SCRIPT = "#!/bin/sh\n# fleetctl lab fault: an interpreter that hangs forever\nexec sleep 2147483647\n"


def _delay(sd: Path, state: dict, h: dict, kind: str, arg: str | int | None) -> None:
    """`delay MS`: each direction, by the host's delayproxy (SIGHUP rereads <host dir>/delay_ms);
    0 clears. Raises UsageError unless MS is a whole number >= 0."""
    if arg is None:
        raise UsageError("delay needs MS: a whole number of milliseconds >= 0 (0 clears)")
    try:
        ms = int(arg)
    except ValueError:
        ms = -1
    if ms < 0:
        raise UsageError(f"delay needs a whole number of milliseconds >= 0, not {arg!r}")
    (host_dir(sd, h["name"]) / "delay_ms").write_text(f"{ms}\n")
    os.kill(h["proxy_pid"], signal.SIGHUP)
    h["faults"]["delay_ms"] = ms


def _link(sd: Path, state: dict, h: dict, kind: str, arg: str | int | None) -> None:
    """`down`/`up`: the bridge side of the host's veth (connects time out while it is down)."""
    run(["ip", "link", "set", h["veth"], kind])
    h["faults"]["down"] = kind == "down"


def _freeze(sd: Path, state: dict, h: dict, kind: str, arg: str | int | None) -> None:
    """`freeze`/`thaw`: SIGSTOP/SIGCONT the host's sshd (TCP is accepted, no banner comes)."""
    os.kill(h["sshd_pid"], signal.SIGSTOP if kind == "freeze" else signal.SIGCONT)
    h["faults"]["frozen"] = kind == "freeze"


def _rekey(sd: Path, state: dict, h: dict, kind: str, arg: str | int | None) -> None:
    """`rekey`: a new host key (the original kept as *.orig; known_hosts keeps the old one) /
    `unrekey`: the original key back; either way sshd is restarted (thawed too), the state saved
    and its banner waited for (LabError if none comes)."""
    hd = host_dir(sd, h["name"])
    k, orig = hd / "ssh_host_ed25519_key", hd / "ssh_host_ed25519_key.orig"
    if kind == "rekey":
        if not orig.exists():
            k.rename(orig)
            k.with_name(k.name + ".pub").rename(orig.with_name(orig.name + ".pub"))
        for p in (k, k.with_name(k.name + ".pub")):
            p.unlink(missing_ok=True)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h["name"], "-f", str(k)])
    elif orig.exists():
        orig.replace(k)
        orig.with_name(orig.name + ".pub").replace(k.with_name(k.name + ".pub"))
    for sig in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.kill(h["sshd_pid"], sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while alive(h["sshd_pid"]) and time.monotonic() < deadline:  # free 127.0.0.1:22
        time.sleep(0.05)
    h["sshd_pid"] = start_sshd(h, sd)
    h["faults"]["rekeyed"], h["faults"]["frozen"] = kind == "rekey", False
    save(sd, state)
    wait_banner(h["address"])


def _hang(sd: Path, state: dict, h: dict, kind: str, arg: str | int | None) -> None:
    """`hang`: /opt/sglang/venv/bin/python* replaced by HANG_SCRIPT, a script that sleeps forever
    (the originals kept in <host dir>/hang-backup) / `unhang`: the originals restored."""
    hd = host_dir(sd, h["name"])
    bindir = hd / PRIVATE_DIRS["/opt/sglang"] / "venv" / "bin"
    backup = hd / "hang-backup"
    backup.mkdir(exist_ok=True)
    for name in VENV_PYTHONS:
        if kind == "hang" and not (backup / name).is_symlink() and not (backup / name).exists():
            (bindir / name).rename(backup / name)
            (bindir / name).write_text(HANG_SCRIPT)
            (bindir / name).chmod(0o755)
        elif kind == "unhang" and ((backup / name).is_symlink() or (backup / name).exists()):
            (backup / name).replace(bindir / name)
    h["faults"]["hung"] = kind == "hang"


# kind -> the function that injects or clears it: (state dir, lab state, host, kind, arg) -> None,
# changing the host's entry in the state (its "faults" and pids), which lab_fault then saves
KINDS = {"delay": _delay, "down": _link, "up": _link, "freeze": _freeze, "thaw": _freeze,
         "rekey": _rekey, "unrekey": _rekey, "hang": _hang, "unhang": _hang}
FAULTS = tuple(KINDS)


def lab_fault(host: str, kind: str, arg: str | int | None = None, lab_id: int = 0,
              state_dir: Path | None = None) -> dict:
    """Inject or clear a fault on one lab host (name like "lab-01" or its address); return its faults.

    Kinds: `delay MS` (each direction, by the host's delayproxy; 0 clears), `down`/`up` (the
    bridge side of the host's veth: connects time out), `freeze`/`thaw` (SIGSTOP/SIGCONT sshd:
    TCP is accepted, no banner), `rekey` (a new host key, sshd restarted; known_hosts keeps the
    old one) / `unrekey` (the original key back), `hang`/`unhang` (/opt/sglang/venv/bin/python*
    replaced by a script that sleeps forever / restored). Raises UsageError for a bad kind or
    host, LabError if a step fails.
    """
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    state = load(sd)
    h = find_host(state, host)
    fn = KINDS.get(kind)
    if fn is None:
        raise UsageError(f"unknown fault {kind!r}; kinds: {', '.join(FAULTS)}")
    fn(sd, state, h, kind, arg)
    save(sd, state)
    return dict(h["faults"])
