"""The soak (issue 54): a seeded random walk of fleetctl operations over a lab with servers, faults
injected at random moments inside them, and an independent checker of every host after each.

Run as root on the lab machine:
    PYTHONPATH=agent python3 bench/soak.py --lab-id 80 --seed 1 --ops 100 [--hosts 4] [--minutes M] [--out FILE]
    bash bench/soak_walks.sh MINUTES OPS OUT SEED:LAB_ID...   (several walks at once, summed)
It brings a lab up (`fleetctl lab up --with-server`: real sshd hosts, the SGLang stand-in server,
real SGLang trees), walks, prints the figures (and writes them to FILE, FILE.json), and takes the
lab down. A violation is recorded with its seed and step (replay: the same --seed, --ops at least
the step; every random draw is made in the walk's own thread, so a seed replays the same steps).

Operations (OPS): apply defrag-tier0 (rolling, --serial 1, 2 or 100%), the same with --check,
rollback --last, recover, status, validate, validate --load smoke (SGLang's own benchmark client; the
0.5.10 host left out: its install cannot import it, torchvision), deploy kernel verify_attention (the
CPU backend, --route all), apply route-verify-attention on the 0.5.23 host (its server speculating on
the triton backend, ROUTE_SERVER; the kernel deployed there first, with no fault, when the last
check did not find it current: the route is refused without it), apply defrag-tier0 and rollback --last
on the container host's install (`--install podman:sglang:...`: the lab's last host, its SGLang
checkout served from a rootful Podman container, lab/container.py; the other operations leave that
host out, `recover all` does not), and an overlap: a second operator's apply, rollback or recover started
while an apply runs (per host each either does its work or loses the lock saying so, LOCK_BUSY, and
exits non-zero). A run that fails with no fault injected is a violation.
Faults (FAULTS), each at a random time inside an operation: SIGKILL or SIGTERM of the fleetctl
process (then `fleetctl recover all`); one host's sshd frozen (SIGSTOP), its link down, slowed
(delay 200-1500 ms each way), rekeyed (a new host key: known_hosts keeps the old), or its sshd and
every session SIGKILLed (lab/faults.py sshd-kill: connections cut mid-write); the stand-in server
SIGKILLed (restarted after the operation when no restart handler did); the stand-in failing every
Nth streamed request (during validate --load); the last host's state dir, made a 128 MiB
filesystem of its own before the walk, filled to its last byte (disk-full); the container
restarted (`podman restart`, container-restart: during a container operation). Each is cleared
before the check.

The checker (check) reads each host over plain `ssh`, never through fleetctl's ledger code:
  tree     every file of the host's SGLang tree (site-packages/sglang, __pycache__ left out) hashes
           to its pristine state (read before the first operation) or to a playbook's patched state
           (defrag-tier0's, route-verify-attention's: read after the host's first apply of it that
           reported it `changed`, each playbook's files its own); files neither way, files added
           by no playbook or lost, a playbook's files partly patched, are violations;
  litter   no fleetctl temp file (.NAME.fleetctl-TAG.RAND.tmp, safefs._tmp_name) nor *.orig/*.rej
           left in the tree, /opt/fleetctl-standin, /var/lib/fleetctl-kernels or /tmp;
  lock     no run holds the host's lock (flock -n on /var/lib/fleetctl/lock) when none is running;
  hook     the kernel's `current` (/var/lib/fleetctl-kernels/verify_attention/current) is absent or
           a link to a published build whose PASSED names a module that is there, never half-published;
  status   `fleetctl status all --json` agrees with the files: the files of its applied changes
           under the tree are exactly the files that differ from pristine, a kernel change is
           applied exactly when `current` is there, and after a recover no change is pending;
  container the container's tree (CONTAINER_PROBE, run by the container's Python through `podman
           exec`) as `tree` says, no litter in it or the container's /tmp, its lock free, and
           `status --install` agreeing with it, as `status` says;
  history  the run history (sqlite, read with sqlite3) has one record per fleetctl process the
           soak started (found by its pid): a finished run has its exit code, a SIGKILLed one no
           end (`interrupted`), a SIGTERMed one exit 143 or no end; one killed after it had
           printed its result, the exit code it printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from fleetctl.lab import CHECKOUT, CONTAINER_NAME, VENV

SITE = "/opt/sglang/venv/lib/python3.11/site-packages"
KDIR = "/var/lib/fleetctl-kernels/verify_attention"  # deploy kernel's published builds and `current`
STANDIN = "/opt/fleetctl-standin"  # the stand-in server's directory on a lab host
KERNELS = Path(__file__).resolve().parents[1] / "kernels"
OPS = ("apply", "apply-check", "rollback", "recover", "status", "validate", "validate-load", "deploy", "route",
       "overlap", "container", "container-rollback")
OP_WEIGHTS = (4, 1, 3, 1, 1, 1, 1, 1, 1, 1, 2, 1)
# the faults each operation may get: a kill of fleetctl where it changes hosts; the stand-in's
# every-Nth failure where a streamed request (the load client's) is sent; an overlap is itself the fault
HOST_FAULTS = ("freeze", "down", "delay", "rekey", "sshd-kill", "crash", "disk-full")
# on the container host: its sshd's and link's faults, and the container restarted (`podman restart`)
CONTAINER_FAULTS = ("freeze", "down", "delay", "rekey", "sshd-kill", "container-restart")
FAULTS = ("sigkill", "sigterm", *HOST_FAULTS, "fail-every", "container-restart")
OP_FAULTS = {"apply": ("sigkill", "sigterm", *HOST_FAULTS), "rollback": ("sigkill", "sigterm", *HOST_FAULTS),
             "recover": ("sigkill", "sigterm", *HOST_FAULTS), "deploy": ("sigkill", "sigterm", *HOST_FAULTS),
             "route": ("sigkill", "sigterm", *HOST_FAULTS),
             "apply-check": HOST_FAULTS, "status": HOST_FAULTS, "validate": HOST_FAULTS,
             # the stand-in failing every Nth request is the fault a load gate exists for, and only
             # this operation can draw it: weighted 3 in 10 of its faults, so a long walk sees it
             "validate-load": ("fail-every",) * 3 + HOST_FAULTS, "overlap": (),
             "container": ("sigkill", "sigterm", *CONTAINER_FAULTS),
             "container-rollback": ("sigkill", "sigterm", *CONTAINER_FAULTS)}
FAULT_P = 0.5  # chance that an operation gets a fault
CHANGING = ("apply", "rollback", "recover", "deploy", "route", "container", "container-rollback")  # a kill: a crash mid-change
OP_TIMEOUT_S = 420  # a run still going then is a violation (hang) and is killed
COMMON = ("--json", "--connect-timeout", "5")
# disk-full: the state dir of the walk's last host (one every operation changes: the first, 0.4.6,
# is one defrag-tier0 skips) is a small filesystem of its own (SMALL_FS, made
# before the first operation), filled to its last byte by FILL for the fault's while, then emptied
STATE_DIR = "/var/lib/fleetctl"
FILLER = f"{STATE_DIR}/.soak-filler"
SMALL_FS = (f"[ -z \"$(ls -A {STATE_DIR})\" ] && mount -t tmpfs -o size=128m,mode=0755 soak-small-fs {STATE_DIR} "
            f"&& stat -f -c %T {STATE_DIR}")
FILL = (f"a=$(df --output=avail -B1 {STATE_DIR} | tail -n 1); fallocate -l $a {FILLER} 2>/dev/null || "
        f"dd if=/dev/zero of={FILLER} bs=64k 2>/dev/null; df --output=avail -B1 {STATE_DIR} | tail -n 1")
LOCK_BUSY = "another fleetctl run is changing this host"  # connection/base.py LockBusy: the loser's reason
ARGV = {
    "apply": ("apply", "defrag-tier0", "HOSTS", "--yes", "--run-timeout", "360",
              "--health-timeout", "90"),
    "apply-check": ("apply", "defrag-tier0", "HOSTS", "--check", "--run-timeout", "120"),
    "rollback": ("rollback", "--last", "HOSTS", "--yes", "--timeout", "90", "--run-timeout", "180"),
    "recover": ("recover", "all", "--yes", "--timeout", "90", "--run-timeout", "180"),
    "status": ("status", "HOSTS", "--run-timeout", "120"),
    "validate": ("validate", "HOSTS", "--health-timeout", "90", "--run-timeout", "240"),
    # SGLang's own benchmark client on each host (the 0.5.10 host left out: its install lacks torchvision)
    "validate-load": ("validate", "LOADABLE", "--health-timeout", "90", "--load", "smoke", "--run-timeout", "300"),
    "deploy": ("deploy", "kernel", "verify_attention", "HOSTS", "--yes", "--backend", "cpu", "--route", "all",
               "--max-jobs", "2", "--health-timeout", "90", "--run-timeout", "400"),
    # the route host alone: SGLang's target verify routed to the kernel deployed there, under the
    # route gate (its server speculates on the triton backend: ROUTE_SERVER)
    "route": ("apply", "route-verify-attention", "ROUTE_HOST", "--yes", "--repeat", "1", "--health-timeout", "90",
              "--run-timeout", "400"),
    "deploy-route-host": ("deploy", "kernel", "verify_attention", "ROUTE_HOST", "--yes", "--backend", "cpu",
                          "--route", "all", "--max-jobs", "2", "--health-timeout", "90", "--run-timeout", "400"),
    # the container host's install: the SGLang checkout in its Podman container (lab/container.py)
    "container": ("apply", "defrag-tier0", "CONTAINER_HOST", "--install", "INSTALL", "--yes", "--repeat", "1",
                  "--health-timeout", "90", "--run-timeout", "400"),
    "container-rollback": ("rollback", "--last", "CONTAINER_HOST", "--install", "INSTALL", "--yes", "--timeout", "90",
                           "--run-timeout", "180"),
    "container-status": ("status", "CONTAINER_HOST", "--install", "INSTALL", "--run-timeout", "120"),
}
PLAYBOOKS = {"apply": "defrag-tier0", "route": "route-verify-attention", "container": "defrag-tier0"}  # what it changes
# route: the host of this release has its server speculate on triton (what route-verify-attention
# routes: tests/fleet/test_fleet_route_verify.py), by the restart command its inventory gives
ROUTE_RELEASE = "0.5.23"
ROUTE_SERVER = "--attention-backend triton --speculative-algorithm STANDALONE --speculative-num-draft-tokens 4"
# one ssh per host per check: the tree's hashes, the litter, whether the lock is free, the hook's kernel
PROBE = (f"cd {SITE} && find sglang -type f ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum; "
         "echo '#litter'; find " + SITE + "/sglang /opt/fleetctl-standin /var/lib/fleetctl-kernels /tmp "
         "\\( -name '.*.fleetctl-*.tmp' -o -name '*.orig' -o -name '*.rej' \\) -print 2>/dev/null; "
         "echo '#lock'; if [ -e /var/lib/fleetctl/lock ]; then flock -n -E 75 /var/lib/fleetctl/lock true; "
         "echo $?; else echo 0; fi; "
         # `current`: absent, or a link to a published build whose PASSED names a module that is there
         f"echo '#hook'; if [ -L {KDIR}/current ]; then t=$(readlink {KDIR}/current); "
         f"case $t in /*) d=$t;; *) d={KDIR}/$t;; esac; "
         "if [ -s \"$d/PASSED\" ] && [ -f \"$(cat \"$d/PASSED\")\" ]; then echo \"current $t\"; "
         "else echo \"broken $t\"; fi; "
         f"elif [ -e {KDIR}/current ]; then echo 'broken not-a-link'; else echo absent; fi")

# the container host (--container): the stand-in server in a rootful Podman container of an image of
# SGLang CONTAINER_RELEASE's checkout (lab/container.py); its install, what its tree is hashed
# under, and the checker's probe of it, run by the container's own Python through `podman exec`
# (the image has no shell): the tree's hashes, the litter in it and /tmp, whether its lock is free
CONTAINER_RELEASE = "0.5.10"
CONTAINER_PYTHON = f"{VENV}/bin/python"
CONTAINER_TOP = f"{CHECKOUT}/python"  # the tree's paths are relative to it (sglang/...)
CONTAINER_INSTALL = f"podman:{CONTAINER_NAME}:{CONTAINER_TOP}/sglang"
CONTAINER_PROBE = r"""
import fcntl, hashlib, json, os, sys
top, out = sys.argv[1], {"tree": {}, "litter": [], "lock": 0}
def litter(name):
    return name.endswith((".orig", ".rej")) or (name.startswith(".") and ".fleetctl-" in name and name.endswith(".tmp"))
for d, dirs, files in os.walk(os.path.join(top, "sglang")):
    dirs[:] = sorted(x for x in dirs if x != "__pycache__")
    for f in files:
        p = os.path.join(d, f)
        with open(p, "rb") as fh:
            out["tree"][os.path.relpath(p, top)] = hashlib.sha256(fh.read()).hexdigest()
        if litter(f):
            out["litter"].append(p)
out["litter"] += ["/tmp/" + f for f in os.listdir("/tmp") if litter(f)]
try:
    fd = os.open("/var/lib/fleetctl/lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        out["lock"] = 75
except FileNotFoundError:
    pass
sys.stdout.write(json.dumps(out))
"""
CONTAINER_UP = (f"[ \"$(podman container inspect -f '{{{{.State.Running}}}}' {CONTAINER_NAME})\" = true ] || "
                f"{{ podman start {CONTAINER_NAME} >/dev/null && echo started; }}")


@dataclass
class Figures:
    """What one soak counted: operations by kind, faults by kind, recoveries, violations."""
    seed: int
    ops: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    recoveries: int = 0
    crashes: int = 0  # fleetctl processes killed (SIGKILL/SIGTERM) and recovered after
    runs: int = 0  # fleetctl processes started
    unrecorded: int = 0  # of them killed before they recorded their run (during start-up)
    late_kills: int = 0  # of them killed after they had finished (printed their result)
    violations: list = field(default_factory=list)  # (step, kind, text)
    seconds: float = 0.0

    def to_json(self) -> dict:
        """The figures as a JSON object (what --sum reads back: from_json)."""
        return {"seed": self.seed, "ops": dict(self.ops), "faults": dict(self.faults), "recoveries": self.recoveries,
                "crashes": self.crashes, "runs": self.runs, "unrecorded": self.unrecorded,
                "late_kills": self.late_kills, "violations": self.violations, "seconds": self.seconds}

    @staticmethod
    def from_json(d: dict) -> "Figures":
        return Figures(seed=d["seed"], ops=Counter(d["ops"]), faults=Counter(d["faults"]), recoveries=d["recoveries"],
                       crashes=d["crashes"], runs=d["runs"], unrecorded=d["unrecorded"],
                       late_kills=d.get("late_kills", 0), violations=[tuple(v) for v in d["violations"]], seconds=d["seconds"])

    def text(self) -> str:
        """The figures as the lines committed under bench/results/."""
        lines = [f"seed {self.seed}: {sum(self.ops.values())} operations in {self.seconds:.0f} s "
                 f"({self.runs} fleetctl runs, {self.unrecorded} killed before recording, {self.late_kills} after finishing)",
                 "operations: " + ", ".join(f"{k} {v}" for k, v in sorted(self.ops.items())),
                 f"faults: {sum(self.faults.values())} (" + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) + ")",
                 f"control-node crashes survived: {self.crashes}; recoveries run: {self.recoveries}"]
        lines += [f"violations: {len(self.violations)}"]
        lines += [f"  seed {self.seed} step {s}: [{k}] {t}" for s, k, t in self.violations]
        return "\n".join(lines) + "\n"


def parse_probe(out: str) -> tuple[dict, list, int, str]:
    """PROBE's output -> ({path under SITE: sha256}, [litter paths], the lock's flock status:
    0 free, 75 held, the hook's kernel: "absent", "current KEY" or "broken WHAT")."""
    tree_part, rest = out.split("#litter\n", 1)
    litter_part, rest = rest.split("#lock\n", 1)
    lock_part, hook_part = rest.split("#hook\n", 1)
    tree = {}
    for line in tree_part.splitlines():
        sha, path = line.split(None, 1)
        tree[path.strip()] = sha
    return tree, [p for p in litter_part.splitlines() if p.strip()], int(lock_part.split()[0]), hook_part.strip()


def tree_state(base: dict, known: dict, tree: dict) -> tuple[set, list]:
    """A tree ({path: sha256}) against its pristine state `base` and the playbooks' patched states
    `known` ({playbook: {path: sha256}}): (the paths that differ from pristine, what is wrong: a
    path lost, added by no playbook, hashing to neither its pristine nor a patched state, a
    playbook's files partly patched)."""
    patched = {p: sha for files in known.values() for p, sha in files.items()}
    differ, wrong = set(), []
    for path in sorted(set(base) | set(tree)):
        if tree.get(path) == base.get(path):
            continue
        differ.add(path)
        if path not in tree:
            wrong.append(f"{path} lost")
        elif patched.get(path) != tree[path]:
            wrong.append(f"{path} " + (f"hashes to neither its pristine nor a patched state ({tree[path][:12]}: "
                                       f"pristine {base[path][:12]}, patched {(patched.get(path) or 'none')[:12]})"
                                       if path in base else
                                       "added with bytes no playbook writes" if path in patched else "added"))
    for playbook, files in known.items():  # each playbook's files all patched or none
        if differ & set(files) and not set(files) <= differ:
            wrong.append(f"{playbook} partly patched: {sorted(differ & set(files))} of {sorted(files)}")
    return differ, wrong


class Soak:
    """One walk over `lab` (an object with hosts, status (lab_status's list), env, ssh(host,
    command) and fault(host, kind, arg): tests/conftest.py's Lab, or LabHandle below) from `seed`.
    A lab with a `container_host` (LabHandle's, made by main) has the container operations'
    host: the other operations leave it out, its host install is checked to stay pristine."""

    def __init__(self, lab, seed: int, history: Path, log=print, serials=("1", "2", "100%"), hold=(1.0, 8.0),
                 ops=OPS, weights=OP_WEIGHTS, fault_p=FAULT_P, faults=FAULTS):
        """`serials`: the --serial values an apply draws from; `hold`: (least, most) seconds a host
        fault lasts; `ops`, `weights`: the operations drawn from and their weights."""
        self.lab, self.rng, self.history, self.log = lab, random.Random(seed), history, log
        self.serials, self.hold, self.ops, self.weights, self.fault_p = serials, hold, ops, weights, fault_p
        self.op_faults = {op: tuple(f for f in kinds if f in faults) for op, kinds in OP_FAULTS.items()}
        self.fig = Figures(seed)
        self.chost = getattr(lab, "container_host", None)
        self.hosts = [h for h in lab.hosts if h != self.chost]  # the host installs' operations' hosts
        if any(op.startswith("container") for op in ops) and self.chost is None:
            raise RuntimeError("the container operations need a lab with a container host (bench/soak.py main)")
        # the trees checked: each host's SGLang install (SITE), and the container's (CONTAINER_TOP), keyed ckey
        self.ckey = f"{self.chost}:{CONTAINER_NAME}" if self.chost else None
        self.env = {**lab.env, "FLEETCTL_HISTORY": str(history), "FLEETCTL_KERNELS_DIR": str(KERNELS)}
        self.pristine: dict[str, dict] = {}
        # tree (a host, or ckey) -> playbook -> {path: sha}
        self.patched: dict[str, dict[str, dict]] = {h: {} for h in [*lab.hosts, *([self.ckey] if self.ckey else [])]}
        self.hooks: dict[str, str] = {}  # host -> the hook's kernel at the last check (PROBE's #hook)
        # (pid, start time, end time, how it ended: None or killed-SIG, exit status, the exit_code
        # its --json document gave when it printed one: a run killed after it finished)
        self.started: list[tuple[int, float, float, str | None, int, int | None]] = []
        self.step = 0
        releases = {h["name"]: h.get("release") for h in lab.status}
        # validate --load runs SGLang's benchmark client, which 0.5.10's install cannot import (torchvision)
        self.loadable = ",".join(h for h in self.hosts if releases.get(h) != "0.5.10")
        self.route_host = next((h for h in self.hosts if releases.get(h) == ROUTE_RELEASE), None) if "route" in ops else None
        if "route" in ops and self.route_host is None:
            raise RuntimeError(f"the route operation needs a host of SGLang {ROUTE_RELEASE} in the lab")

    def violation(self, kind: str, text: str) -> None:
        self.fig.violations.append((self.step, kind, text))
        self.log(f"  VIOLATION step {self.step} [{kind}] {text}")

    def probe(self, host: str) -> tuple[dict, list, int, str]:
        r = self.lab.ssh(host, PROBE, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"{host}: probe failed ({r.returncode}): {r.stderr[-500:]}")
        return parse_probe(r.stdout)

    def container_probe(self) -> dict:
        """CONTAINER_PROBE in the container: {"tree": {path under CONTAINER_TOP: sha256}, "litter",
        "lock": 0 free, 75 held}."""
        r = self.lab.ssh(self.chost, shlex.join(["podman", "exec", "-w", "/", CONTAINER_NAME, CONTAINER_PYTHON, "-c",
                                                 CONTAINER_PROBE, CONTAINER_TOP]), timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"{self.ckey}: probe failed ({r.returncode}): {r.stderr[-500:]}")
        return json.loads(r.stdout)

    def tree(self, key: str) -> dict:
        """The tree `key` names (a host's install, or the container's: ckey) as {path: sha256}."""
        return self.container_probe()["tree"] if key == self.ckey else self.probe(key)[0]

    def argv(self, op: str) -> list[str]:
        names = {"LOADABLE": self.loadable, "ROUTE_HOST": self.route_host, "HOSTS": ",".join(self.hosts),
                 "CONTAINER_HOST": self.chost, "INSTALL": CONTAINER_INSTALL}
        argv = [sys.executable, "-m", "fleetctl.cli", *(names.get(a, a) for a in ARGV[op]), *COMMON]
        if op == "apply":
            argv += ["--serial", self.rng.choice(self.serials)]
        return argv

    def spawn(self, op: str) -> tuple[subprocess.Popen, float, Path]:
        """Start `op` as its own fleetctl process, its output to files (no pipe to fill)."""
        out = self.tmp / f"{self.fig.runs}.out"
        with open(out, "w") as fo, open(out.with_suffix(".err"), "w") as fe:
            p = subprocess.Popen(self.argv(op), env=self.env, stdout=fo, stderr=fe, text=True)
        self.fig.runs += 1
        return p, time.time(), out

    def reap(self, op: str, p: subprocess.Popen, t0: float, out: Path, ended: str | None) -> tuple[str, dict | None]:
        """Wait for `p` (a hang is a violation, then killed); record it. (its stderr, its JSON or None)."""
        try:
            p.wait(timeout=max(1.0, OP_TIMEOUT_S - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            self.violation("hang", f"{op} ran over {OP_TIMEOUT_S} s: {out.with_suffix('.err').read_text()[-300:]}")
        err = out.with_suffix(".err").read_text()
        try:
            doc = json.loads(out.read_text())
        except json.JSONDecodeError:
            doc = None
        printed = doc.get("exit_code") if isinstance(doc, dict) else None
        self.started.append((p.pid, t0, time.time(), ended, p.returncode, printed))
        out.unlink()
        out.with_suffix(".err").unlink()
        return err, doc

    def inject(self, fault: str, host: str, p: subprocess.Popen, at: float, hold: float, arg: int,
               done: threading.Event) -> None:
        """`fault` on `host` (or on fleetctl's process `p`) `at` seconds in, held `hold` seconds
        (fail-every: until `p` ends; any fault: no longer than `p`), then cleared; `arg`: a
        delay's ms, a fail-every's N."""
        if done.wait(at):
            return
        if fault in ("sigkill", "sigterm"):
            if p.poll() is None:
                self.ended = f"killed-{fault}"  # before the signal: the process may be reaped at once
                p.send_signal(signal.SIGKILL if fault == "sigkill" else signal.SIGTERM)
                self.fig.faults[fault] += 1
                self.fig.crashes += 1
            return
        self.fig.faults[fault] += 1
        if fault == "sshd-kill":  # every connection to the host cut at once, sshd back at once
            self.lab.fault(host, "sshd-kill")
        elif fault == "crash":  # the stand-in server SIGKILLed; healed after the operation
            self.lab.ssh(host, f"kill -9 $(cat {STANDIN}/server.pid)")
        elif fault == "container-restart":  # what a runtime's restart policy or an operator does
            r = self.lab.ssh(host, f"podman restart --time 2 {CONTAINER_NAME}", timeout=60)
            if r.returncode != 0:
                self.log(f"    container-restart: podman said {r.returncode}: {r.stderr.strip()[-200:]}")
        elif fault == "disk-full":  # the small state dir's filesystem full, then emptied
            r = self.lab.ssh(self.hosts[-1], FILL)
            if r.stdout.split()[-1:] != ["0"]:
                self.log(f"    disk-full: {r.stdout.strip()} bytes still free")
            done.wait(hold)
            self.lab.ssh(self.hosts[-1], f"rm -f {FILLER}")
            host = self.hosts[-1]
        else:
            on, off = {"freeze": ("freeze", "thaw"), "down": ("down", "up"), "delay": ("delay", "delay"),
                       "rekey": ("rekey", "unrekey"), "fail-every": ("fail-every", "fail-every")}[fault]
            self.lab.fault(host, on, arg if on in ("delay", "fail-every") else None)
            # fail-every until the operation ends: only the load client's streamed requests fail,
            # and they come after the health wait and the smoke decodes (a hold of 1-8 s from
            # 0.3-4 s in ended before them: entry 10 of bench/results/soak-findings.md)
            done.wait(None if fault == "fail-every" else hold)
            self.lab.fault(host, off, 0 if off in ("delay", "fail-every") else None)
        held = (" until the operation ended" if fault == "fail-every" else "" if fault in (
            "sshd-kill", "crash", "container-restart") else f" for {hold:.1f}s")
        self.log(f"    {fault} {host} at {at:.1f}s{held}")

    def small_fs(self) -> None:
        """The last host's state dir made a small filesystem of its own (SMALL_FS), where disk-full
        fills it. Raises RuntimeError when it cannot be (a state dir not empty: the walk must start
        on a fresh lab)."""
        r = self.lab.ssh(self.hosts[-1], SMALL_FS)
        if r.returncode != 0 or r.stdout.strip() != "tmpfs":
            raise RuntimeError(f"{self.hosts[-1]}: no small filesystem at {STATE_DIR}: {r.stdout}{r.stderr}")

    def run(self, op: str, fault: str | None) -> tuple[int | None, dict | None]:
        """Run `op` as its own fleetctl process, `fault` injected at a random moment. Returns (exit
        status, None when killed by the soak; its JSON document or None)."""
        at = self.rng.uniform(0.3, 4.0)
        hold = self.rng.uniform(*self.hold)
        host = self.rng.choice(self.loadable.split(",") if op == "validate-load" else
                               [self.route_host] if op in ("route", "deploy-route-host") else
                               [self.chost] if op.startswith("container") else self.hosts)
        arg = self.rng.choice((1, 2, 3)) if fault == "fail-every" else self.rng.choice((200, 500, 1500))
        p, t0, out = self.spawn(op)  # every draw made here, none in the thread: a seed replays
        done = threading.Event()
        self.ended = None
        th = threading.Thread(target=self.inject, args=(fault, host, p, at, hold, arg, done), daemon=True) if fault else None
        if th:
            th.start()
        err, doc = self.reap(op, p, t0, out, None)
        done.set()
        if th:
            th.join()
            self.started[-1] = (*self.started[-1][:3], self.ended, *self.started[-1][4:])
        self.log(f"    {op} exit {p.returncode}: " + ", ".join(
            f"{h['host']} {h.get('status')}" + (f" ({(h.get('error') or '')[:100]})" if h.get("error") else "")
            for h in (doc or {}).get("hosts", [])) + ("" if (doc or {}).get("hosts") else err[-400:].replace("\n", " | ")))
        if self.ended is None and fault is None and p.returncode != 0:
            why = {h["host"]: h.get("error") for h in (doc or {}).get("hosts", []) if h.get("error")}
            self.violation("exit", f"{op} exited {p.returncode} with no fault injected: {why or err[-300:]}")
        return (None if self.ended else p.returncode), doc

    def overlap(self) -> tuple[dict | None, tuple[str, dict | None]]:
        """A second operator: an apply, and `delay` seconds into it another apply, a rollback or a
        recover of the same hosts. Per host, each run either did its work or lost the host's lock,
        saying so (LOCK_BUSY) and exiting non-zero. Returns (the apply's JSON document, (the other
        run's operation, its JSON document))."""
        other = self.rng.choice(("apply", "rollback", "recover"))
        delay = self.rng.uniform(0.2, 3.0)
        self.log(f"    second operator: {other} at {delay:.1f}s")
        p1, t1, o1 = self.spawn("apply")
        time.sleep(delay)
        p2, t2, o2 = self.spawn(other)
        docs = []
        for op, p, t, o in (("apply", p1, t1, o1), (other, p2, t2, o2)):
            err, doc = self.reap(op, p, t, o, None)
            docs.append(doc)
            lost = []
            for h in (doc or {}).get("hosts", []):
                if h.get("status") in ("failed", "unreachable"):
                    if LOCK_BUSY in (h.get("error") or ""):
                        lost.append(h["host"])
                    else:
                        self.violation("overlap", f"{op}: {h['host']} {h.get('status')}: {h.get('error')}")
            if doc is None:
                self.violation("overlap", f"{op} exited {p.returncode} with no JSON: {err[-300:]}")
            elif lost and p.returncode == 0:
                self.violation("overlap", f"{op} lost the lock of {lost} but exited 0")
            if lost:
                self.fig.faults["lock-lost"] += 1
        return docs[0], (other, docs[1])

    def learn(self, doc: dict | None, playbook: str, inside: bool = False) -> None:
        """After a finished apply of `playbook`: each host it `changed` gives that playbook's
        patched files there (the first time), in the host's tree or, `inside`, the container's:
        the files that differ from pristine and are no other playbook's (each playbook's files
        are its own: defrag-tier0's allocator files, route-verify-attention's hook module and
        triton_backend.py)."""
        for h in (doc or {}).get("hosts", []):
            key = self.ckey if inside else h["host"]
            known = self.patched[key]
            if h.get("status") == "changed" and playbook not in known and not doc.get("check"):
                tree = self.tree(key)
                base = self.pristine[key]
                others = {p for files in known.values() for p in files}
                known[playbook] = {p: s for p, s in tree.items() if base.get(p) != s and p not in others}
                self.log(f"    {key}: {playbook}'s patched state: " + ", ".join(f"{p} {s[:12]}" for p, s in known[playbook].items()))

    def restart_cmd(self, host: str) -> str:
        """The stand-in's restart command on `host`, as its inventory gives it."""
        return f"{STANDIN}/restart.sh" + (f" {ROUTE_SERVER}" if host == self.route_host else "")

    def route_server(self) -> None:
        """The route host's server restarted speculating on triton, and its inventory's restart
        command (the restart handler's) made the one that starts it so."""
        self.lab.add_host_vars(self.route_host, {"fleetctl_restart_cmd": self.restart_cmd(self.route_host)})
        r = self.lab.ssh(self.route_host, self.restart_cmd(self.route_host))
        if r.returncode != 0:
            raise RuntimeError(f"{self.route_host}: the server did not restart: {r.stderr[-300:]}")

    def heal(self) -> None:
        """After an operation: a stand-in server the crash fault killed (and no restart handler
        brought back) started again, so the next operation's gate has a server; the container
        host's container started when it is not running (CONTAINER_UP: `recover` restarts one a
        killed run was changing; another may have been stopped by a restart fault cut short)."""
        def one(h: str) -> str:
            if h == self.chost:
                return self.lab.ssh(h, CONTAINER_UP, timeout=60).stdout
            cmd = f"kill -0 $(cat {STANDIN}/server.pid) 2>/dev/null || {{ {self.restart_cmd(h)}; echo restarted; }}"
            return self.lab.ssh(h, cmd).stdout
        with ThreadPoolExecutor(len(self.lab.hosts)) as pool:
            said = dict(zip(self.lab.hosts, pool.map(one, self.lab.hosts)))
        for host, out in said.items():
            if "restarted" in out or "started" in out:
                self.log(f"    {host}: {'container' if host == self.chost else 'stand-in'} {out.strip()}")

    def status(self, op: str) -> subprocess.Popen:
        """`op` (status or container-status: ARGV's) started, its output piped, counted as a run."""
        p = subprocess.Popen(self.argv(op), env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        p.t0 = time.time()
        self.fig.runs += 1
        return p

    def status_hosts(self, p: subprocess.Popen) -> dict:
        """A status run's hosts by name ({} and a violation when it printed no JSON)."""
        out, err = p.communicate(timeout=OP_TIMEOUT_S)
        self.started.append((p.pid, p.t0, time.time(), None, p.returncode, None))
        try:
            return {h["host"]: h for h in json.loads(out)["hosts"]}
        except (json.JSONDecodeError, KeyError):
            self.violation("status", f"status printed no JSON (exit {p.returncode}): {err[-300:]}")
            return {}

    def agrees(self, name: str, h: dict | None, top: str, differ: set, recovered: bool) -> set:
        """`status`'s host `h` against the tree `name` under `top` whose files `differ` from
        pristine: ok, its applied changes' files under `top` exactly those, nothing pending
        after a recover. Returns the applied changes' files (empty when status failed)."""
        if h is None or h.get("status") != "ok":
            self.violation("status", f"{name}: status {h and h.get('status')}: {h and h.get('error')}")
            return set()
        applied = {f for c in h["changes"] if c["state"] == "applied" for f in c["files"]}
        want = {f"{top}/{p}" for p in differ}
        if {f for f in applied if f.startswith(top + "/")} != want:
            self.violation("status", f"{name}: status says applied {sorted(applied)}, files differ {sorted(want)}")
        pending = [c["change_id"] for c in h["changes"] if c["state"] == "pending"]
        if recovered and pending:
            self.violation("status", f"{name}: pending after recover: {pending}")
        return applied

    def check(self, recovered: bool) -> None:
        """The checker (see the module docstring)."""
        pool = ThreadPoolExecutor(len(self.lab.hosts) + 1)  # the trees read while status runs
        probes = {host: pool.submit(self.probe, host) for host in self.lab.hosts}
        inside = pool.submit(self.container_probe) if self.chost else None
        runs = [self.status("status")] + ([self.status("container-status")] if self.chost else [])
        statuses = [self.status_hosts(p) for p in runs]
        try:
            probes = {host: f.result() for host, f in probes.items()}
            inside = inside and inside.result()
        finally:
            pool.shutdown()
        for host in self.lab.hosts:
            tree, litter, lock, hook = probes[host]
            self.hooks[host] = hook
            differ, wrong = tree_state(self.pristine[host], self.patched[host], tree)
            for text in wrong:
                self.violation("tree", f"{host}: {text}")
            if litter:
                self.violation("litter", f"{host}: {litter}")
            if lock != 0:
                self.violation("lock", f"{host}: the lock is held with no fleetctl running")
            if hook.startswith("broken"):
                self.violation("hook", f"{host}: the hook's kernel is half-published: {hook}")
            if host == self.chost or not statuses[0]:
                continue  # the container host's own install: nothing changes it, pristine is its check
            applied = self.agrees(host, statuses[0].get(host), SITE, differ, recovered)
            if applied and (f"{KDIR}/current" in applied) != hook.startswith("current"):
                self.violation("hook", f"{host}: status says the kernel is {'' if f'{KDIR}/current' in applied else 'not '}"
                                       f"applied, the hook's kernel is {hook}")
        if inside is not None:
            differ, wrong = tree_state(self.pristine[self.ckey], self.patched[self.ckey], inside["tree"])
            for text in wrong:
                self.violation("tree", f"{self.ckey}: {text}")
            if inside["litter"]:
                self.violation("litter", f"{self.ckey}: {inside['litter']}")
            if inside["lock"] != 0:
                self.violation("lock", f"{self.ckey}: the container's lock is held with no fleetctl running")
            if statuses[1]:
                self.agrees(self.ckey, statuses[1].get(self.chost), CONTAINER_TOP, differ, recovered)

    def check_history(self) -> None:
        """One record per fleetctl process started (see the module docstring): found by its pid
        and its start within the process's lifetime; its recorded end agrees with how it ended."""
        con = sqlite3.connect(f"file:{self.history}?mode=ro", uri=True)
        rows = con.execute("SELECT pid, started_at, ended_at, exit_code FROM runs").fetchall()
        con.close()
        unrecorded = 0
        for pid, t0, t1, killed, rc, printed in self.started:
            recs = [(e, c) for p, s, e, c in rows if p == pid and t0 - 1 <= s <= t1 + 1]
            if not recs and killed:
                unrecorded += 1  # killed in its start-up, before it could record its run
                continue
            if len(recs) != 1:
                self.violation("history", f"pid {pid} ({killed or 'exit %s' % rc}): {len(recs)} records")
                continue
            ended, code = recs[0]
            if killed and printed is not None:  # the kill came after it had finished and printed its result
                self.fig.late_kills += 1
                if code != printed:
                    self.violation("history", f"pid {pid} ({killed} after it printed exit {printed}): recorded {code}")
            elif killed == "killed-sigkill" and ended is not None:
                self.violation("history", f"pid {pid} SIGKILLed but recorded as ended, exit {code}")
            elif killed != "killed-sigkill" and code != (128 - rc if rc < 0 else rc):
                self.violation("history", f"pid {pid} ({killed or 'finished'}) exited {rc}, recorded {code}")
        self.fig.unrecorded = unrecorded
        if len(rows) != self.fig.runs - unrecorded:
            self.violation("history", f"{len(rows)} records for {self.fig.runs} runs ({unrecorded} killed before recording)")

    def walk(self, n: int, until: float | None = None) -> Figures:
        """Run `n` operations (each then checked), or fewer when time.time() passes `until`.
        Returns the figures."""
        t = time.monotonic()
        self.tmp = Path(tempfile.mkdtemp(prefix="soak-runs-"))  # each run's output, removed at the end
        if any("disk-full" in self.op_faults[op] for op in self.ops):
            self.small_fs()
        if self.route_host:
            self.route_server()
        for host in self.lab.hosts:
            self.pristine[host], _, _, self.hooks[host] = self.probe(host)
        if self.chost:
            self.pristine[self.ckey] = self.container_probe()["tree"]
        for self.step in range(1, n + 1):
            if until is not None and time.time() > until:
                self.log(f"stopped before step {self.step}: the time given is up")
                break
            op = self.rng.choices(self.ops, self.weights)[0]
            fault = (self.rng.choice(self.op_faults[op]) if self.op_faults[op] and self.rng.random() < self.fault_p
                     else None)
            self.log(f"step {self.step}: {op}" + (f" + {fault}" if fault else ""))
            t_step = time.monotonic()
            self.fig.ops[op] += 1
            if op == "overlap":
                first, (other, second) = self.overlap()
                self.learn(first, PLAYBOOKS["apply"])
                if other == "apply":  # a rollback's or recover's `changed` is no patched tree
                    self.learn(second, PLAYBOOKS["apply"])
                rc = 0
            else:
                if op == "route" and not self.hooks.get(self.route_host, "").startswith("current"):
                    # the route is refused without the kernel: deployed there first, no fault
                    self.log(f"    {self.route_host}: no current kernel ({self.hooks.get(self.route_host)}): deployed first")
                    if self.run("deploy-route-host", None)[0] != 0:
                        self.heal()
                rc, doc = self.run(op, fault)
                if op in PLAYBOOKS:  # a run killed after it printed its result learns as a finished one
                    self.learn(doc, PLAYBOOKS[op], inside=op == "container")
            self.heal()
            recovered = False
            if rc is None or (fault and op in CHANGING):
                self.fig.recoveries += 1
                rrc, _ = self.run("recover", None)
                recovered = rrc == 0
            t_op = time.monotonic()
            self.check(recovered)
            self.log(f"  step {self.step}: operation {t_op - t_step:.1f} s, check {time.monotonic() - t_op:.1f} s")
        self.check_history()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.fig.seconds = time.monotonic() - t
        return self.fig


@dataclass
class LabHandle:
    """A lab this script brought up (the subset of tests/conftest.py's Lab the soak uses)."""
    lab_id: int
    state_dir: Path
    hosts: list
    env: dict
    known_hosts: Path
    addresses: dict
    status: list
    inventory: Path
    container_host: str | None = None  # the host whose SGLang serves from a container (main)

    def add_host_vars(self, host: str, host_vars: dict) -> None:
        """Add `host_vars` to `host` in the lab's inventory (lab up's YAML)."""
        import yaml
        doc = yaml.safe_load(self.inventory.read_text())
        doc["all"]["children"]["lab"]["hosts"][host].update(host_vars)
        self.inventory.write_text(yaml.safe_dump(doc, sort_keys=False))

    def ssh(self, host: str, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
             "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "ConnectTimeout=5",
             "-i", str(self.state_dir / "client_ed25519"), f"root@{self.addresses[host]}", command],
            capture_output=True, text=True, timeout=timeout)

    def fault(self, host: str, kind: str, arg=None) -> dict:
        from fleetctl import lab as labmod
        return labmod.lab_fault(host, kind, arg, lab_id=self.lab_id, state_dir=self.state_dir)


def container_host(lab: LabHandle) -> None:
    """The lab's last host made the container host: its own stand-in server stopped (the port is
    the container's), the stand-in run in a Podman container of an image of SGLang
    CONTAINER_RELEASE's checkout (lab.add_container_host), a latency slack for its one-decode
    gate (as tests/fleet/test_fleet_containers.py gives it). Raises RuntimeError, LabError."""
    from fleetctl import lab as labmod
    host = lab.hosts[-1]
    r = lab.ssh(host, f"p=$(cat {STANDIN}/server.pid) && kill $p && while kill -0 $p 2>/dev/null; do sleep 0.1; done")
    if r.returncode != 0:
        raise RuntimeError(f"{host}: its stand-in server did not stop: {r.stderr[-300:]}")
    labmod.add_container_host(host, CONTAINER_RELEASE, lab_id=lab.lab_id, state_dir=lab.state_dir)
    lab.add_host_vars(host, {"fleetctl_latency_slack": 2.0})
    lab.container_host = host


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lab-id", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ops", type=int, default=25)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", help="draw only these operations (comma-separated, of OPS), evenly")
    ap.add_argument("--faults", help="draw only these fault kinds (comma-separated, of FAULTS)")
    ap.add_argument("--fault-p", type=float, default=FAULT_P, help="chance that an operation gets a fault")
    ap.add_argument("--minutes", type=float, help="stop starting operations after this long (the figures say how many ran)")
    a = ap.parse_args(argv)
    from fleetctl import lab as labmod
    from fleetctl.wheels import cache_dir
    home = Path(tempfile.mkdtemp(prefix="fleetctl-soak-"))
    known = home / "known_hosts"
    sd = labmod.state_dir_for(a.lab_id)
    ops = tuple(a.only.split(",")) if a.only else OPS
    container = any(op.startswith("container") for op in ops)
    inv = labmod.lab_up(a.hosts + container, labmod.DEFAULT_RELEASES, with_server=True, lab_id=a.lab_id,
                        state_dir=sd, known_hosts=known)
    try:
        cfg = home / "ssh_config"
        cfg.write_text(f"Host *\n  UserKnownHostsFile {known}\n")
        st = labmod.lab_status(a.lab_id, sd)
        env = dict(os.environ, FLEETCTL_SSH_CONFIG=str(cfg), FLEETCTL_INVENTORY=str(inv),
                   FLEETCTL_WHEEL_CACHE=str(cache_dir()))
        lab = LabHandle(a.lab_id, sd, [h["name"] for h in st], env, known, {h["name"]: h["address"] for h in st}, st,
                        Path(inv))
        if container:
            container_host(lab)
        until = time.time() + a.minutes * 60 if a.minutes else None
        weights = (1,) * len(ops) if a.only else OP_WEIGHTS
        soak = Soak(lab, a.seed, home / "history.sqlite", ops=ops, weights=weights, fault_p=a.fault_p,
                    faults=tuple(a.faults.split(",")) if a.faults else FAULTS)
        try:
            fig = soak.walk(a.ops, until)
        except Exception as e:  # the figures so far, and why the walk stopped, counted as a violation
            fig = soak.fig
            fig.violations.append((soak.step, "walk", f"the walk stopped: {e!r}"))
    finally:
        labmod.lab_down(a.lab_id, sd, known)
    print(fig.text(), end="")
    if a.out:
        a.out.write_text(fig.text())
        a.out.with_suffix(".json").write_text(json.dumps(fig.to_json()) + "\n")
    return 1 if fig.violations else 0


def sum_walks(paths: list[Path]) -> str:
    """The figures of several walks (their --out FILE.json), summed, then each walk's own."""
    figs = [Figures.from_json(json.loads(p.read_text())) for p in paths]
    total = Figures(seed=-1)
    for f in figs:
        total.ops += f.ops
        total.faults += f.faults
        for k in ("recoveries", "crashes", "runs", "unrecorded", "late_kills"):
            setattr(total, k, getattr(total, k) + getattr(f, k))
        total.violations += [(f"{f.seed}:{s}", k, t) for s, k, t in f.violations]
        total.seconds = max(total.seconds, f.seconds)
    head = (f"{len(figs)} walks in parallel, seeds {', '.join(str(f.seed) for f in figs)}; summed "
            f"(the time is the longest walk's):\n")
    return head + total.text().replace("seed -1: ", "all: ").replace("seed -1 step ", "seed:step ") + "".join("\n" + f.text() for f in figs)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--sum"]:  # bench/soak.py --sum OUT WALK.json...
        Path(sys.argv[2]).write_text(sum_walks([Path(p) for p in sys.argv[3:]]))
        sys.exit(0)
    sys.exit(main())
