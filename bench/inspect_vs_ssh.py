"""Benchmark: `fleetctl inspect all` against plain OpenSSH running DESIGN.md's one-line grep.

Both run in one go against the same lab hosts (real sshd in network namespaces) with the same
added latency (the lab's userspace delay proxy holds each chunk D ms each way). The baseline is
the operator's old habit, fanned out with `xargs -P`:

    ssh root@HOST "grep -rnE 'TokenToKVPoolAllocator\\(|need_sort=' $SRT/model_executor/*.py \
                   $SRT/mem_cache/*.py | grep -v 'def ' | head"

(host keys verified here too; the baseline's StrictHostKeyChecking=no is not reproduced).
fleetctl does strictly more: interpreter discovery, facts, a whole-package AST scan.

Usage (root):  python bench/inspect_vs_ssh.py [--hosts 8] [--delay-ms 50] [--runs 3]
Prints the median wall time of each and the ratio fleetctl / ssh.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fleetctl import lab

LAB_ID = 5
SRT = "/opt/sglang/venv/lib/python3.11/site-packages/sglang/srt"
GREP = (f"grep -rnE 'TokenToKVPoolAllocator\\(|need_sort=' {SRT}/model_executor/*.py {SRT}/mem_cache/*.py"
        " | grep -v 'def ' | head")


def timed(cmd: list[str], env: dict, **kw) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, **kw)
    return time.perf_counter() - t0, r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--delay-ms", type=int, default=50)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="fleetctl-bench-"))
    known = home / ".ssh" / "known_hosts"
    sd = lab.state_dir_for(LAB_ID)
    inv = lab.lab_up(a.hosts, lab.DEFAULT_RELEASES, lab_id=LAB_ID, state_dir=sd, known_hosts=known)
    env = dict(os.environ, HOME=str(home), FLEETCTL_INVENTORY=str(inv))
    try:
        hosts = lab.lab_status(LAB_ID, sd)
        for h in hosts:
            lab.lab_fault(h["name"], "delay", a.delay_ms, lab_id=LAB_ID, state_dir=sd)
        addrs = "\n".join(h["address"] for h in hosts) + "\n"
        ssh = ["xargs", "-P", str(len(hosts)), "-I{}", "timeout", "25", "ssh", "-o", "BatchMode=yes",
               "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known}",
               "-i", str(sd / "client_ed25519"), "root@{}", GREP]
        fl = [sys.executable, "-m", "fleetctl.cli", "inspect", "all", "--json"]
        t_ssh, t_fl = [], []
        for _ in range(a.runs):
            t, r = timed(ssh, env, input=addrs)
            assert r.returncode == 0, r.stderr
            t_ssh.append(t)
            t, r = timed(fl, env)
            assert r.returncode == 0, r.stderr[-2000:]
            t_fl.append(t)
        ms, mf = statistics.median(t_ssh), statistics.median(t_fl)
        print(f"hosts={len(hosts)} delay={a.delay_ms}ms each way runs={a.runs}")
        print(f"plain ssh + grep (xargs -P): median {ms:.2f} s  {['%.2f' % x for x in t_ssh]}")
        print(f"fleetctl inspect all:        median {mf:.2f} s  {['%.2f' % x for x in t_fl]}")
        print(f"ratio fleetctl/ssh: {mf / ms:.2f}")
    finally:
        if not a.keep:
            lab.lab_down(LAB_ID, sd, known)
    return 0


if __name__ == "__main__":
    sys.exit(main())
