"""Faults injected into and cleared from one lab host: a table of kinds (KINDS), each a small
function, behind lab_fault; and the stand-in server's behaviours (BEHAVIOURS), set in its
behaviour file (fleetctl/lab/standin/server.py's docstring)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

from ..errors import UsageError
from .base import (PRIVATE_DIRS, VENV_PYTHONS, LabError, alive, find_host, host_dir, load, require_root, run,
                   save, state_dir_for, wait_banner)
from .host import start_sshd
from .pidns import root_pid
from .standin.engine import EXPERTS, LAYERS

HANG_SCRIPT = "#!/bin/sh\n# fleetctl lab fault: an interpreter that hangs forever\nexec sleep 2147483647\n"


def _whole(kind: str, arg: str | int | None, what: str) -> int:
    """`arg` as a whole number >= 0; UsageError naming the fault kind and what it counts otherwise."""
    try:
        n = int(arg) if arg is not None else -1
    except ValueError:
        n = -1
    if n < 0:
        raise UsageError(f"{kind} needs {what}: a whole number >= 0 (0 clears), not {arg!r}")
    return n


def _delay(sd: Path, state: dict, h: dict, kind: str, arg: str | int | None) -> None:
    """`delay MS`: each direction, by the host's delayproxy (SIGHUP rereads <host dir>/delay_ms);
    0 clears. Raises UsageError unless MS is a whole number >= 0."""
    ms = _whole(kind, arg, "MS, milliseconds")
    (host_dir(sd, h["name"]) / "delay_ms").write_text(f"{ms}\n")
    os.kill(h["proxy_pid"], signal.SIGHUP)
    h["faults"]["delay_ms"] = ms


def _link(sd: Path, state: dict, h: dict, kind: str, arg: str | int | None) -> None:
    """`down`/`up`: the bridge side of the host's veth (connects time out while it is down)."""
    run(["ip", "link", "set", h["veth"], kind])
    h["faults"]["down"] = kind == "down"


def _waiter(h: dict) -> int | None:
    """The pid of the nsenter that started the host's sshd and waits on it (its parent), or None
    once it is gone. util-linux nsenter --fork stops itself when its child stops and is continued
    by nothing but a signal of its own (sys-utils/nsenter.c, continue_as_child): a thaw that
    continued sshd alone left it stopped, and a stopped nsenter never reaps its killed sshd (a
    zombie that `lab.host_pids` lists)."""
    try:
        stat = Path(f"/proc/{h['sshd_pid']}/stat").read_text()
    except OSError:
        return None
    ppid = int(stat[stat.rindex(")") + 2:].split()[1])
    try:
        return ppid if Path(f"/proc/{ppid}/comm").read_text().strip() == "nsenter" else None
    except OSError:
        return None


def _state_of(pid: int) -> str:
    """The one-letter state of `pid` (proc(5) /proc/PID/stat field 3), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(") ")[2][:1]
    except OSError:
        return ""


def _freeze(sd: Path, state: dict, h: dict, kind: str, arg: str | int | None) -> None:
    """`freeze`: SIGSTOP the host's sshd (TCP is accepted, no banner comes), and wait (at most 2 s)
    until its nsenter has stopped itself too, so that a thaw finds it stopped / `thaw`: SIGCONT
    both, the nsenter first (see _waiter)."""
    waiter = _waiter(h)
    if kind == "freeze":
        os.kill(h["sshd_pid"], signal.SIGSTOP)
        deadline = time.monotonic() + 2
        while waiter and _state_of(waiter) not in ("T", "") and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        _continue(h, waiter)
    h["faults"]["frozen"] = kind == "freeze"


def _continue(h: dict, waiter: int | None) -> None:
    """SIGCONT the host's sshd's nsenter (`waiter`, if any) and then sshd itself."""
    for pid in (waiter, h["sshd_pid"]):
        try:
            if pid:
                os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _restart_sshd(sd: Path, state: dict, h: dict, sig: signal.Signals, sessions: list[int]) -> None:
    """Thaw the host's sshd, send it and `sessions` `sig`, wait (at most 5 s) until it is gone,
    start a new one, save the state and wait for its banner (LabError if none comes)."""
    _continue(h, _waiter(h))
    for pid in (h["sshd_pid"], *sessions):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while alive(h["sshd_pid"]) and time.monotonic() < deadline:  # free 127.0.0.1:22
        time.sleep(0.05)
    h["sshd_pid"] = start_sshd(h, sd)
    h["faults"]["frozen"] = False
    save(sd, state)
    wait_banner(h["address"])


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
    h["faults"]["rekeyed"] = kind == "rekey"
    _restart_sshd(sd, state, h, signal.SIGTERM, [])


def _sshd_children(pid: int) -> list[int]:
    """The sshd processes forked under `pid` (its sessions: comm `sshd` or `sshd-session`, and theirs),
    from /proc's parent links (root-view pids)."""
    parents = {}
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
        except (OSError, ValueError):
            continue
        if d.name.isdigit():
            comm_end = stat.rindex(")")
            parents[int(d.name)] = (int(stat[comm_end + 2:].split()[1]), stat[stat.index("(") + 1:comm_end])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, (pp, _) in parents.items() if pp == p]
        frontier += kids
        found += [c for c in kids if parents[c][1].startswith("sshd")]
    return found


def _sshd_kill(sd: Path, state: dict, h: dict, kind: str, arg: str | int | None) -> None:
    """`sshd-kill`: SIGKILL the host's sshd and every sshd session under it (each open connection cut
    wherever it was, mid-write or not; the commands they ran see their pipes close), then a new
    sshd started, the state saved and its banner waited for (LabError if none comes)."""
    _restart_sshd(sd, state, h, signal.SIGKILL, _sshd_children(h["sshd_pid"]))


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
         "rekey": _rekey, "unrekey": _rekey, "hang": _hang, "unhang": _hang, "sshd-kill": _sshd_kill}
# stand-in behaviour kind -> (its key in the behaviour file, what its argument counts); `behave`
# empties the file
BEHAVIOURS = {"contention": ("contention_ms", "MS, milliseconds per decode step per other request in flight"),
              "fail-every": ("fail_every", "N, every Nth streamed /generate request fails"),
              "slow-attention": ("slow_attention_ms", "MS, milliseconds more in each attention kernel"),
              "hot-expert": ("hot_expert", "LAYER:EXPERT, the MoE layer and its expert every token goes to "
                                           "(off clears)"),
              "behave": (None, None)}
FAULTS = tuple(KINDS) + tuple(BEHAVIOURS)
STANDIN = "/opt/fleetctl-standin"  # the stand-in's directory on a lab host (host.start_server)
RELOAD_WAIT_S = 10.0  # for the server's "behaviour reloaded" log line


def _hot_expert(kind: str, arg: str | int | None, what: str) -> dict | None:
    """`hot-expert LAYER:EXPERT` as the stand-in's behaviour value {"layer", "expert"} (the MoE
    model's: standin/engine.py LAYERS, EXPERTS), None for `off`; UsageError otherwise."""
    if arg == "off":
        return None
    m = re.fullmatch(r"(\d+):(\d+)", str(arg))
    if not m or int(m[1]) >= LAYERS or int(m[2]) >= EXPERTS:
        raise UsageError(f"{kind} needs {what}: layer 0..{LAYERS - 1}, expert 0..{EXPERTS - 1}, not {arg!r}")
    return {"layer": int(m[1]), "expert": int(m[2])}


def _behaviour(sd: Path, h: dict, kind: str, arg: str | int | None, at_restart: bool) -> None:
    """`contention MS` / `fail-every N` / `slow-attention MS` (0 clears) / `hot-expert L:E` (off
    clears) / `behave`: merge the key into the stand-in's
    behaviour file on the host (STANDIN/behavior.json) or empty it, written whole through a
    rename. Then, unless `at_restart`, the running server (STANDIN/server.pid) rereads it at once
    (SIGHUP) and this waits for its log line saying so; with `at_restart` the server takes it up
    when it next starts (an apply's restart handler, say). Raises UsageError (a bad argument),
    LabError (the file is not a JSON object; no stand-in server runs there; it did not reload)."""
    key, what = BEHAVIOURS[kind]
    if key is None and arg is not None:
        raise UsageError(f"behave takes no argument, not {arg!r}")
    value = None if key is None else (_hot_expert if kind == "hot-expert" else _whole)(kind, arg, what)
    d = host_dir(sd, h["name"]) / PRIVATE_DIRS[STANDIN]
    bfile = d / "behavior.json"
    behavior = {}
    if key is not None and bfile.exists():
        try:
            behavior = json.loads(bfile.read_text())
        except ValueError:
            behavior = None
        if not isinstance(behavior, dict):
            raise LabError(f"{h['name']}: {STANDIN}/behavior.json is not a JSON object; "
                           f"empty it with `fleetctl lab fault {h['name']} behave`")
    if key is not None:
        behavior.pop(key, None)
        if value:
            behavior[key] = value
    tmp = bfile.with_name("behavior.json.tmp")
    tmp.write_text(json.dumps(behavior) + "\n")
    tmp.replace(bfile)
    if key is None:
        for k, _ in BEHAVIOURS.values():
            h["faults"].pop(k, None)
    else:
        h["faults"][key] = value
    if at_restart:
        return
    pid = _server_pid(h, d)
    log = d / "server.log"
    start = log.stat().st_size if log.exists() else 0
    os.kill(pid, signal.SIGHUP)
    want = f"behaviour reloaded: {json.dumps(behavior, sort_keys=True)}"
    deadline = time.monotonic() + RELOAD_WAIT_S
    while time.monotonic() < deadline:
        with open(log, "rb") as f:
            f.seek(start)
            if want.encode() in f.read():
                return
        time.sleep(0.05)
    raise LabError(f"{h['name']}: the stand-in server (pid {pid}) did not reload its behaviour within "
                   f"{RELOAD_WAIT_S:.0f} s; see {STANDIN}/server.log on the host")


def _server_pid(h: dict, d: Path) -> int:
    """Root-view pid of the stand-in server running from STANDIN on the host (its pid file holds
    the host's view), checked to be that server.py. Raises LabError when none runs."""
    try:
        nspid = int((d / "server.pid").read_text())
    except (OSError, ValueError):
        nspid = None
    pid = root_pid(h["init_pid"], nspid) if nspid else None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if pid else []
    except OSError:
        cmdline = []
    if f"{STANDIN}/server.py".encode() not in cmdline:
        raise LabError(f"{h['name']}: no stand-in server runs from {STANDIN} (pid file {nspid}); start it "
                       f"(`{STANDIN}/restart.sh` on the host), or write the behaviour for its next start "
                       "with --at-restart")
    return pid


def lab_fault(host: str, kind: str, arg: str | int | None = None, lab_id: int = 0,
              state_dir: Path | None = None, at_restart: bool = False) -> dict:
    """Inject or clear a fault on one lab host (name like "lab-01" or its address); return its faults.

    Kinds: `delay MS` (each direction, by the host's delayproxy; 0 clears), `down`/`up` (the
    bridge side of the host's veth: connects time out), `freeze`/`thaw` (SIGSTOP/SIGCONT sshd:
    TCP is accepted, no banner), `rekey` (a new host key, sshd restarted; known_hosts keeps the
    old one) / `unrekey` (the original key back), `sshd-kill` (sshd and its sessions SIGKILLed,
    every connection cut, a new sshd started), `hang`/`unhang` (/opt/sglang/venv/bin/python*
    replaced by a script that sleeps forever / restored). The stand-in server's behaviours:
    `contention MS` (each decode step MS ms longer per other request in flight), `fail-every N`
    (every Nth streamed /generate answers 500), `slow-attention MS` (each attention kernel MS ms
    longer), 0 clearing each, `hot-expert LAYER:EXPERT` (the MoE model's router sends every token
    of LAYER to EXPERT; off clears), and `behave` (all cleared):
    in effect at once (the server rereads its behaviour file), or with `at_restart` only from
    the server's next start. Raises UsageError for a bad kind, argument or host, LabError if a
    step fails.
    """
    require_root()
    sd = state_dir_for(lab_id, state_dir)
    state = load(sd)
    h = find_host(state, host)
    if kind in BEHAVIOURS:
        _behaviour(sd, h, kind, arg, at_restart)
    elif kind not in KINDS:
        raise UsageError(f"unknown fault {kind!r}; kinds: {', '.join(FAULTS)}")
    elif at_restart:
        raise UsageError(f"--at-restart is for the stand-in's behaviours ({', '.join(BEHAVIOURS)}), not {kind}")
    else:
        KINDS[kind](sd, state, h, kind, arg)
    save(sd, state)
    return dict(h["faults"])
