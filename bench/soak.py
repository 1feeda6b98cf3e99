"""The soak (issue 54): a seeded random walk of fleetctl operations over a lab with servers, faults
injected at random moments inside them, and an independent checker of every host after each.

Run as root on the lab machine:
    PYTHONPATH=agent python3 bench/soak.py --lab-id 70 --seed 1 --ops 100 [--hosts 4] [--out FILE]
It brings a lab up (`fleetctl lab up --with-server`: real sshd hosts, the SGLang stand-in server,
real SGLang trees), walks, prints the figures (and writes them to FILE), and takes the lab down.

Operations (OPS): apply defrag-tier0 (rolling, --serial 1 or 2), the same with --check, rollback
--last, recover, status, validate. Faults (FAULTS), each at a random time inside an operation:
SIGKILL or SIGTERM of the fleetctl process (then `fleetctl recover all`), one host's sshd frozen
(SIGSTOP) or its link down for a random while (lab/faults.py), cleared before the check.

The checker (check) reads each host over plain `ssh`, never through fleetctl's ledger code:
  tree     every file of the host's SGLang tree (site-packages/sglang, __pycache__ left out) hashes
           to its pristine state (read before the first operation) or to its patched state (read
           after the host's first apply that reported it `changed`); files neither way, files
           added or lost, are violations;
  litter   no fleetctl temp file (.NAME.fleetctl-TAG.RAND.tmp, safefs._tmp_name) nor *.orig/*.rej
           left in the tree, /opt/fleetctl-standin, /var/lib/fleetctl-kernels or /tmp;
  lock     no run holds the host's lock (flock -n on /var/lib/fleetctl/lock) when none is running;
  status   `fleetctl status all --json` agrees with the files: the files of its applied changes are
           exactly the files that differ from pristine, and after a recover no change is pending;
  history  the run history (sqlite, read with sqlite3) has one record per fleetctl process the
           soak started (found by its pid): a finished run has its exit code, a SIGKILLed one no
           end (`interrupted`), a SIGTERMed one exit 143 or no end.
A violation is recorded with its seed and step (replay: the same --seed, --ops at least the step).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SITE = "/opt/sglang/venv/lib/python3.11/site-packages"
OPS = ("apply", "apply-check", "rollback", "recover", "status", "validate")
OP_WEIGHTS = (4, 1, 3, 1, 1, 1)
FAULTS = ("sigkill", "sigterm", "freeze", "down")
FAULT_P = 0.5  # chance that an operation gets a fault
CHANGING = ("apply", "rollback", "recover")  # where a kill is a crash mid-change
OP_TIMEOUT_S = 420  # a run still going then is a violation (hang) and is killed
COMMON = ("--json", "--connect-timeout", "5")
ARGV = {
    "apply": ("apply", "defrag-tier0", "all", "--yes", "--run-timeout", "360",
              "--health-timeout", "30"),
    "apply-check": ("apply", "defrag-tier0", "all", "--check", "--run-timeout", "120"),
    "rollback": ("rollback", "--last", "all", "--yes", "--timeout", "90", "--run-timeout", "180"),
    "recover": ("recover", "all", "--yes", "--timeout", "90", "--run-timeout", "180"),
    "status": ("status", "all", "--run-timeout", "120"),
    "validate": ("validate", "all", "--health-timeout", "30", "--run-timeout", "120"),
}
# one ssh per host per check: the tree's hashes, the litter, whether the lock is free
PROBE = (f"cd {SITE} && find sglang -type f ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum; "
         "echo '#litter'; find " + SITE + "/sglang /opt/fleetctl-standin /var/lib/fleetctl-kernels /tmp "
         "\\( -name '.*.fleetctl-*.tmp' -o -name '*.orig' -o -name '*.rej' \\) -print 2>/dev/null; "
         "echo '#lock'; if [ -e /var/lib/fleetctl/lock ]; then flock -n -E 75 /var/lib/fleetctl/lock true; "
         "echo $?; else echo 0; fi")


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
    violations: list = field(default_factory=list)  # (step, kind, text)
    failed: list = field(default_factory=list)  # (step, text): runs that failed with no fault injected
    seconds: float = 0.0

    def text(self) -> str:
        """The figures as the lines committed under bench/results/."""
        lines = [f"seed {self.seed}: {sum(self.ops.values())} operations in {self.seconds:.0f} s "
                 f"({self.runs} fleetctl runs, {self.unrecorded} killed before recording)",
                 "operations: " + ", ".join(f"{k} {v}" for k, v in sorted(self.ops.items())),
                 f"faults: {sum(self.faults.values())} (" + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) + ")",
                 f"control-node crashes survived: {self.crashes}; recoveries run: {self.recoveries}",
                 f"runs failed with no fault injected: {len(self.failed)}"]
        lines += [f"  seed {self.seed} step {s}: {t}" for s, t in self.failed]
        lines += [f"violations: {len(self.violations)}"]
        lines += [f"  seed {self.seed} step {s}: [{k}] {t}" for s, k, t in self.violations]
        return "\n".join(lines) + "\n"


def parse_probe(out: str) -> tuple[dict, list, int]:
    """PROBE's output -> ({path under SITE: sha256}, [litter paths], the lock's flock status:
    0 free, 75 held)."""
    tree_part, rest = out.split("#litter\n", 1)
    litter_part, lock_part = rest.split("#lock\n", 1)
    tree = {}
    for line in tree_part.splitlines():
        sha, path = line.split(None, 1)
        tree[path.strip()] = sha
    return tree, [p for p in litter_part.splitlines() if p.strip()], int(lock_part.split()[0])


class Soak:
    """One walk over `lab` (an object with hosts, env, ssh(host, command) and fault(host, kind,
    arg): tests/conftest.py's Lab, or LabHandle below) from `seed`."""

    def __init__(self, lab, seed: int, history: Path, log=print, serials=("1", "1", "2"), hold=(1.0, 8.0)):
        """`serials`: the --serial values an apply draws from; `hold`: (least, most) seconds a host
        fault lasts."""
        self.lab, self.rng, self.history, self.log = lab, random.Random(seed), history, log
        self.serials, self.hold = serials, hold
        self.fig = Figures(seed)
        self.env = {**lab.env, "FLEETCTL_HISTORY": str(history)}
        self.pristine: dict[str, dict] = {}
        self.patched: dict[str, dict] = {}
        self.started: list[tuple[int, float, str]] = []  # (pid, start time, how it ended: rc / killed-SIG)
        self.step = 0

    def violation(self, kind: str, text: str) -> None:
        self.fig.violations.append((self.step, kind, text))
        self.log(f"  VIOLATION step {self.step} [{kind}] {text}")

    def probe(self, host: str) -> tuple[dict, list, int]:
        r = self.lab.ssh(host, PROBE, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"{host}: probe failed ({r.returncode}): {r.stderr[-500:]}")
        return parse_probe(r.stdout)

    def run(self, op: str, fault: str | None) -> tuple[int | None, dict | None]:
        """Run `op` as its own fleetctl process, `fault` injected at a random moment. Returns (exit
        status, None when killed by the soak; its JSON document or None)."""
        argv = [sys.executable, "-m", "fleetctl.cli", *ARGV[op], *COMMON]
        if op == "apply":
            argv += ["--serial", self.rng.choice(self.serials)]
        at = self.rng.uniform(0.3, 4.0)
        hold = self.rng.uniform(*self.hold)
        host = self.rng.choice(self.lab.hosts)
        t0 = time.time()
        p = subprocess.Popen(argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.fig.runs += 1
        killed = threading.Event()

        def inject():
            if killed.wait(at):
                return
            if fault in ("sigkill", "sigterm"):
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL if fault == "sigkill" else signal.SIGTERM)
                    self.fig.faults[fault] += 1
                    self.fig.crashes += 1
                    self.ended = f"killed-{fault}"
                return
            on, off = ("freeze", "thaw") if fault == "freeze" else ("down", "up")
            self.lab.fault(host, on)
            self.fig.faults[fault] += 1
            self.log(f"    {fault} {host} at {at:.1f}s for {hold:.1f}s")
            time.sleep(hold)
            self.lab.fault(host, off)

        self.ended = None
        th = threading.Thread(target=inject, daemon=True) if fault else None
        if th:
            th.start()
        try:
            out, err = p.communicate(timeout=OP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            self.violation("hang", f"{op} ran over {OP_TIMEOUT_S} s: {err[-300:]}")
        killed.set()
        if th:
            th.join()
        self.started.append((p.pid, t0, time.time(), self.ended, p.returncode))
        try:
            doc = json.loads(out)
        except json.JSONDecodeError:
            doc = None
        if self.ended is None and fault is None and p.returncode != 0:
            # not a violation by itself (a gate may fail on a loaded machine: its change is rolled
            # back, which the checker then verifies); counted and shown with each host's reason
            why = {h["host"]: h.get("error") for h in (doc or {}).get("hosts", []) if h.get("error")}
            self.fig.failed.append((self.step, f"{op} exited {p.returncode}: {why or err[-300:]}"))
        return (None if self.ended else p.returncode), doc

    def learn(self, doc: dict | None) -> None:
        """After a finished apply: each host it `changed` gives its patched tree (first time)."""
        for h in (doc or {}).get("hosts", []):
            if h.get("status") == "changed" and h["host"] not in self.patched and not doc.get("check"):
                tree, _, _ = self.probe(h["host"])
                base = self.pristine[h["host"]]
                self.patched[h["host"]] = {p: s for p, s in tree.items() if base.get(p) != s}

    def check(self, recovered: bool) -> None:
        """The checker (see the module docstring)."""
        t0 = time.time()
        r = subprocess.Popen([sys.executable, "-m", "fleetctl.cli", "status", "all", *COMMON], env=self.env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        r.stdout, r.stderr = r.communicate(timeout=OP_TIMEOUT_S)
        self.fig.runs += 1
        self.started.append((r.pid, t0, time.time(), None, r.returncode))
        try:
            status = {h["host"]: h for h in json.loads(r.stdout)["hosts"]}
        except (json.JSONDecodeError, KeyError):
            status = {}
            self.violation("status", f"status printed no JSON (exit {r.returncode}): {r.stderr[-300:]}")
        for host in self.lab.hosts:
            tree, litter, lock = self.probe(host)
            base, patch = self.pristine[host], self.patched.get(host, {})
            differ = set()
            for path in set(base) | set(tree):
                if tree.get(path) == base.get(path):
                    continue
                differ.add(path)
                if path not in tree or path not in base:
                    self.violation("tree", f"{host}: {path} {'lost' if path not in tree else 'added'}")
                elif patch.get(path) != tree[path]:
                    self.violation("tree", f"{host}: {path} hashes to neither its pristine nor its patched state")
            if differ and patch and differ != set(patch):
                self.violation("tree", f"{host}: partly patched: {sorted(differ)} of {sorted(patch)}")
            if litter:
                self.violation("litter", f"{host}: {litter}")
            if lock != 0:
                self.violation("lock", f"{host}: the lock is held with no fleetctl running")
            h = status.get(host)
            if h is None or h.get("status") != "ok":
                if status:
                    self.violation("status", f"{host}: status {h and h.get('status')}: {h and h.get('error')}")
                continue
            applied = {f for c in h["changes"] if c["state"] == "applied" for f in c["files"]}
            want = {f"{SITE}/{p}" for p in differ}
            if applied != want:
                self.violation("status", f"{host}: status says applied {sorted(applied)}, files differ {sorted(want)}")
            pending = [c["change_id"] for c in h["changes"] if c["state"] == "pending"]
            if recovered and pending:
                self.violation("status", f"{host}: pending after recover: {pending}")

    def check_history(self) -> None:
        """One record per fleetctl process started (see the module docstring): found by its pid
        and its start within the process's lifetime; its recorded end agrees with how it ended."""
        con = sqlite3.connect(f"file:{self.history}?mode=ro", uri=True)
        rows = con.execute("SELECT pid, started_at, ended_at, exit_code FROM runs").fetchall()
        con.close()
        unrecorded = 0
        for pid, t0, t1, killed, rc in self.started:
            recs = [(e, c) for p, s, e, c in rows if p == pid and t0 - 1 <= s <= t1 + 1]
            if not recs and killed:
                unrecorded += 1  # killed in its start-up, before it could record its run
                continue
            if len(recs) != 1:
                self.violation("history", f"pid {pid} ({killed or 'exit %s' % rc}): {len(recs)} records")
                continue
            ended, code = recs[0]
            if killed == "killed-sigkill" and ended is not None:
                self.violation("history", f"pid {pid} SIGKILLed but recorded as ended, exit {code}")
            elif killed != "killed-sigkill" and code != (128 - rc if rc < 0 else rc):
                self.violation("history", f"pid {pid} ({killed or 'finished'}) exited {rc}, recorded {code}")
        self.fig.unrecorded = unrecorded
        if len(rows) != self.fig.runs - unrecorded:
            self.violation("history", f"{len(rows)} records for {self.fig.runs} runs ({unrecorded} killed before recording)")

    def walk(self, n: int) -> Figures:
        """Run `n` operations (each then checked). Returns the figures."""
        t = time.monotonic()
        for host in self.lab.hosts:
            self.pristine[host] = self.probe(host)[0]
        for self.step in range(1, n + 1):
            op = self.rng.choices(OPS, OP_WEIGHTS)[0]
            fault = self.rng.choice(FAULTS) if self.rng.random() < FAULT_P else None
            if fault in ("sigkill", "sigterm") and op not in CHANGING:
                fault = None
            self.log(f"step {self.step}: {op}" + (f" + {fault}" if fault else ""))
            self.fig.ops[op] += 1
            rc, doc = self.run(op, fault)
            if op == "apply" and rc is not None:
                self.learn(doc)
            recovered = False
            if rc is None or (fault and op in CHANGING):
                self.fig.recoveries += 1
                rrc, _ = self.run("recover", None)
                recovered = rrc == 0
            self.check(recovered)
        self.check_history()
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

    def ssh(self, host: str, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
             "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "ConnectTimeout=5",
             "-i", str(self.state_dir / "client_ed25519"), f"root@{self.addresses[host]}", command],
            capture_output=True, text=True, timeout=timeout)

    def fault(self, host: str, kind: str, arg=None) -> dict:
        from fleetctl import lab as labmod
        return labmod.lab_fault(host, kind, arg, lab_id=self.lab_id, state_dir=self.state_dir)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lab-id", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ops", type=int, default=25)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    from fleetctl import lab as labmod
    from fleetctl.wheels import cache_dir
    home = Path(tempfile.mkdtemp(prefix="fleetctl-soak-"))
    known = home / "known_hosts"
    sd = labmod.state_dir_for(a.lab_id)
    inv = labmod.lab_up(a.hosts, labmod.DEFAULT_RELEASES, with_server=True, lab_id=a.lab_id, state_dir=sd,
                        known_hosts=known)
    try:
        cfg = home / "ssh_config"
        cfg.write_text(f"Host *\n  UserKnownHostsFile {known}\n")
        st = labmod.lab_status(a.lab_id, sd)
        env = dict(os.environ, FLEETCTL_SSH_CONFIG=str(cfg), FLEETCTL_INVENTORY=str(inv),
                   FLEETCTL_WHEEL_CACHE=str(cache_dir()))
        lab = LabHandle(a.lab_id, sd, [h["name"] for h in st], env, known, {h["name"]: h["address"] for h in st})
        fig = Soak(lab, a.seed, home / "history.sqlite").walk(a.ops)
    finally:
        labmod.lab_down(a.lab_id, sd, known)
    print(fig.text(), end="")
    if a.out:
        a.out.write_text(fig.text())
    return 1 if fig.violations else 0


if __name__ == "__main__":
    sys.exit(main())
