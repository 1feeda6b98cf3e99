"""Benchmark: `fleetctl inspect all` against the grep habit and its peers (issue 18).

Everything runs in one go, alternating (round robin, medians), against the same lab hosts (real
sshd in network namespaces, releases round robin) with the same added latency (`fleetctl lab
fault HOST delay D`: the lab's userspace delay proxy holds each chunk D ms each way; D=10 is
"20 ms RTT"). Per fleet size (16 and 64 hosts by default):

  raw OpenSSH grep       xargs -P N ssh HOST "<DESIGN.md's one-line grep>"  (fresh connections)
  raw OpenSSH, masters   the same over live ControlPersist masters opened beforehand (reference)
  Fabric grep            fabric.ThreadingGroup(...).run(grep)
  Ansible ad-hoc grep    ansible all -m shell -a "<grep>" -f N  (its default ssh ControlPersist)
  fleetctl cold          `cache clear all` (not timed), then `inspect all --json` (paramiko)
  fleetctl warm          `inspect all --json` (paramiko): only the hosts' scan caches are warm
  fleetctl ssh           `inspect all --json -c ssh` (OpenSSH, per-run masters)
  fleetctl ssh, live     the same with an ssh_config whose ControlPath names the live masters
                         above (an operator's own ControlMaster setup): no connection is made
  fleetctl warm, named   `inspect all --json` (paramiko) with `ansible_python_interpreter` set for
                         every host (the usual Ansible inventory; issue 28: the trust check now
                         rides on the probe's own start instead of a probe of its own)
  baseline ...           with --baseline-agent DIR: the same named-interpreter line run by the
                         fleetctl package in DIR (an older checkout's agent/), paired; run once
                         untimed first (its probe sources key a cache of their own)
  floor: Python -S       xargs -P N ssh HOST "<the interpreter fleetctl recorded> -S -c pass": what
                         any Python probe costs before it does anything (fresh connections)

plus, on one 0.5.23 host: `ssh HOST grep -rl -e TokenToKVPoolAllocator -e need_sort <package>`
against a warm `fleetctl inspect HOST`, with two floors: fleetctl's start on this machine (its
imports, no host) and `ssh HOST <interpreter> -S -c pass`; and the cold probe's scan phases
against that grep's own time on the host. The control process's CPU seconds (user+sys) and peak RSS come from
/usr/bin/time. Host keys are verified by every client (known_hosts written by the lab).

Usage (root):  python bench/inspect_vs_ssh.py [--hosts 16 64] [--delay-ms 10] [--runs 3]
               [--lab-id 33] [--out bench/results/NAME.json] [--baseline-agent DIR]
Lab ids lab_id, lab_id+1, ... are used per fleet size and taken down afterwards (unless --keep).
Fabric and ansible-core: bench/requirements.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from fleetctl import lab

VENV_SP = "/opt/sglang/venv/lib/python3.11/site-packages"
SRT = f"{VENV_SP}/sglang/srt"
GREP = (f"grep -rnE 'TokenToKVPoolAllocator\\(|need_sort=' {SRT}/model_executor/*.py {SRT}/mem_cache/*.py"
        " | grep -v 'def ' | head")
# A 2-CPU machine hosting 64 lab hosts: connects and a cold scan of all at once take longer than the defaults.
CT = ["--connect-timeout", "60", "--timeout", "600"]
GREP_RL = f"grep -rl -e TokenToKVPoolAllocator -e need_sort {VENV_SP}/sglang"
# the interpreter an Ansible inventory names on every lab host (each has the release's venv)
NAMED_PYTHON = "/opt/sglang/venv/bin/python"
# Python started as fleetctl's probe starts it (the interpreter recorded on the host, no site), doing nothing
PY_FLOOR = 'read -r p < /var/lib/fleetctl/scan-cache/interpreter && exec "$p" -S -c pass'
# fleetctl's start on this machine without a host: the modules `inspect` imports
START = "import fleetctl.cli, fleetctl.engine.gather, fleetctl.connection.paramiko_ssh"
FABRIC = """
import sys
from fabric import ThreadingGroup
hosts, key, cmd = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
g = ThreadingGroup(*hosts, user="root", connect_kwargs={"key_filename": key, "look_for_keys": False})
res = g.run(cmd, hide=True, warn=True)
sys.exit(0 if len(res) == len(hosts) and not res.failed else 1)
"""


def timed(cmd: list[str], env: dict, stdin: str | None = None) -> dict:
    """Run `cmd` under /usr/bin/time: {wall_s, cpu_s (user+sys of it and its children), rss_kb, rc, err}."""
    with tempfile.NamedTemporaryFile("r") as tf:
        t0 = time.perf_counter()
        r = subprocess.run(["/usr/bin/time", "-o", tf.name, "-f", "%U %S %M", *cmd], input=stdin,
                           capture_output=True, text=True, env=env, timeout=900)
        wall = time.perf_counter() - t0
        u, s, m = tf.read().split()[-3:]
    return {"wall_s": wall, "cpu_s": float(u) + float(s), "rss_kb": int(m), "rc": r.returncode,
            "out": r.stdout, "err": r.stderr[-3000:]}


def check(name: str, r: dict) -> dict:
    if r["rc"] != 0:
        raise SystemExit(f"{name} failed (exit {r['rc']}): {r['out'][-3000:]} {r['err']}")
    return r


def fleet_run(n: int, a, lab_id: int, base_env: dict) -> dict:
    """One fleet size: lab up, faults, alternating runs; returns the raw timings and medians."""
    home = Path(tempfile.mkdtemp(prefix="fleetctl-bench-"))
    known = home / ".ssh" / "known_hosts"
    sd = lab.state_dir_for(lab_id)
    t0 = time.time()
    inv = lab.lab_up(n, lab.DEFAULT_RELEASES, lab_id=lab_id, state_dir=sd, known_hosts=known)
    up_s = time.time() - t0
    key = str(sd / "client_ed25519")
    # OpenSSH (and so Ansible) and fleetctl read ~/.ssh of the passwd home, not $HOME: every client
    # is pointed at the lab's known_hosts, never root's own (stale keys of earlier labs live there)
    ssh_config = home / "ssh_config"
    ssh_config.write_text(f"Host *\n  UserKnownHostsFile {known}\n")
    env = dict(base_env, HOME=str(home), FLEETCTL_INVENTORY=str(inv), FLEETCTL_SSH_CONFIG=str(ssh_config),
               ANSIBLE_SSH_ARGS=f"-C -o ControlMaster=auto -o ControlPersist=60s -o UserKnownHostsFile={known}",
               ANSIBLE_HOST_KEY_CHECKING="True",
               ANSIBLE_PRIVATE_KEY_FILE=key, ANSIBLE_FORKS=str(n), ANSIBLE_TIMEOUT="60",
               ANSIBLE_PYTHON_INTERPRETER="/usr/bin/python3")  # pyenv shims on the lab hosts mislead discovery
    named_inv = home / "hosts-named-python.yaml"
    doc = yaml.safe_load(Path(inv).read_text())
    doc.setdefault("all", {}).setdefault("vars", {})["ansible_python_interpreter"] = NAMED_PYTHON
    named_inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    cp = home / "cp"
    cp.mkdir(mode=0o700)
    masters_config = home / "ssh_config_masters"
    masters_config.write_text(f"Host *\n  ControlMaster auto\n  ControlPath {cp}/%C\n  ControlPersist 600\n"
                              f"  UserKnownHostsFile {known}\n")
    try:
        hosts = lab.lab_status(lab_id, sd)
        for h in hosts:
            lab.lab_fault(h["name"], "delay", a.delay_ms, lab_id=lab_id, state_dir=sd)
        addrs = [h["address"] for h in hosts]
        one = next(h for h in hosts if h["release"] == "0.5.23")
        ssh = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known}",
               "-i", key, "-o", "IdentitiesOnly=yes"]
        master = [*ssh, "-o", f"ControlPath={cp}/%C", "-o", "ControlMaster=auto", "-o", "ControlPersist=600"]
        for addr in addrs:  # live masters for the reference line
            subprocess.run([*master, "-M", "-N", "-f", f"root@{addr}"], check=True, timeout=120,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        xargs = ["xargs", "-P", str(n), "-I{}", "timeout", "60"]
        cmds = {
            "raw OpenSSH grep": ([*xargs, *ssh, "root@{}", GREP], "\n".join(addrs) + "\n"),
            "raw OpenSSH grep, live masters": ([*xargs, *master, "root@{}", GREP], "\n".join(addrs) + "\n"),
            "Fabric grep": ([sys.executable, "-c", FABRIC, ",".join(addrs), key, GREP], None),
            "Ansible ad-hoc grep": (["ansible", "all", "-i", str(inv), "-m", "shell", "-a", GREP, "-f", str(n)],
                                    None),
            "fleetctl cold (paramiko)": ([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "--json", *CT], None),
            "fleetctl warm (paramiko)": ([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "--json", *CT], None),
            "fleetctl warm (ssh, per-run masters)": ([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "--json",
                                                      "-c", "ssh", *CT], None),
            "fleetctl warm (ssh, live masters)": ([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "--json",
                                                   "-c", "ssh", *CT], None),
            "fleetctl warm, named interpreter (paramiko)": ([sys.executable, "-m", "fleetctl.cli", "inspect", "all",
                                                             "--json", "-i", str(named_inv), *CT], None),
            "floor: OpenSSH starting Python -S": ([*xargs, *ssh, "root@{}", PY_FLOOR], "\n".join(addrs) + "\n"),
        }
        if a.baseline_agent:
            cmds["baseline warm, named interpreter (paramiko)"] = cmds["fleetctl warm, named interpreter (paramiko)"]
        baseline_env = dict(env, PYTHONPATH=str(a.baseline_agent)) if a.baseline_agent else env
        # the operator's own ControlMaster setup, whose masters (opened above) are live
        masters_env = dict(env, FLEETCTL_SSH_CONFIG=str(masters_config))
        clear = [sys.executable, "-m", "fleetctl.cli", "cache", "clear", "all", "--json", *CT]
        raw: dict[str, list[dict]] = {k: [] for k in cmds}
        docs = {}
        for _ in range(a.runs):
            for name, (cmd, stdin) in cmds.items():
                if name.startswith("fleetctl cold"):
                    check("cache clear", timed(clear, env))
                if name.startswith("baseline"):  # its probe sources differ, and so its cache key: warm it first
                    check(name, timed(cmd, baseline_env, stdin))
                r = timed(cmd, masters_env if "live masters" in name else baseline_env if name.startswith("baseline")
                          else env, stdin)
                if name.startswith(("fleetctl", "baseline")):
                    docs[name] = json.loads(check(name, r)["out"])
                elif r["rc"] != 0:  # a peer's failed run is kept (and said), not the end of the benchmark
                    print(f"{name} failed (exit {r['rc']}): {r['out'][-1500:]} {r['err'][-1500:]}", file=sys.stderr)
                raw[name].append({k: r[k] for k in ("wall_s", "cpu_s", "rss_kb", "rc")})
        # one host: grep -rl over the package, against a warm inspect of that host
        single = {"ssh grep -rl (one 0.5.23 host)": [], "fleetctl warm (one 0.5.23 host)": [],
                  "fleetctl warm, named interpreter (one 0.5.23 host)": [],
                  "floor: fleetctl's start, no host": [], "floor: ssh HOST python -S -c pass": []}
        remote_grep = []
        for _ in range(a.runs):
            r = check("grep -rl", timed([*ssh, f"root@{one['address']}", GREP_RL], env))
            single["ssh grep -rl (one 0.5.23 host)"].append(r["wall_s"])
            r = check("inspect one", timed([sys.executable, "-m", "fleetctl.cli", "inspect", one["name"], "--json", *CT], env))
            single["fleetctl warm (one 0.5.23 host)"].append(r["wall_s"])
            r = check("inspect one, named", timed([sys.executable, "-m", "fleetctl.cli", "inspect", one["name"], "--json",
                                                   "-i", str(named_inv), *CT], env))
            single["fleetctl warm, named interpreter (one 0.5.23 host)"].append(r["wall_s"])
            r = check("fleetctl start", timed([sys.executable, "-c", START], env))
            single["floor: fleetctl's start, no host"].append(r["wall_s"])
            r = check("python floor", timed([*ssh, f"root@{one['address']}", PY_FLOOR], env))
            single["floor: ssh HOST python -S -c pass"].append(r["wall_s"])
            r = check("remote grep time", timed(
                [*ssh, f"root@{one['address']}", "bash -c " + shlex.quote(f"TIMEFORMAT=%R; time {GREP_RL} >/dev/null")],
                env))
            remote_grep.append(float(r["err"].strip().splitlines()[-1]))
        cold_doc = docs["fleetctl cold (paramiko)"]
        cold_one = next(h for h in cold_doc["hosts"] if h["host"] == one["name"])
        warm_one = next(h for h in docs["fleetctl warm (paramiko)"]["hosts"] if h["host"] == one["name"])
        named_one = next(h for h in docs["fleetctl warm, named interpreter (paramiko)"]["hosts"] if h["host"] == one["name"])
        for addr in addrs:
            subprocess.run([*master, "-O", "exit", f"root@{addr}"], capture_output=True, timeout=30)
        return {
            "hosts": n, "lab_up_s": round(up_s, 1), "raw": raw, "single": single,
            "median_wall_s": {k: statistics.median(x["wall_s"] for x in v) for k, v in raw.items()},
            "median_cpu_s": {k: statistics.median(x["cpu_s"] for x in v) for k, v in raw.items()},
            "median_rss_kb": {k: statistics.median(x["rss_kb"] for x in v) for k, v in raw.items()},
            "single_median_s": {k: statistics.median(v) for k, v in single.items()},
            "remote_grep_rl_s": statistics.median(remote_grep),
            "cold_probe_0.5.23": {"scan": {k: cold_one["scan"][k] for k in ("elapsed_s", "phases_s", "cache", "stats")},
                                  "timing": cold_one.get("timing")},
            "warm_probe_0.5.23": {"scan": {k: warm_one["scan"][k] for k in ("elapsed_s", "phases_s", "cache")},
                                  "timing": warm_one.get("timing")},
            "warm_named_probe_0.5.23": {"timing": named_one.get("timing")},
        }
    finally:
        if not a.keep:
            lab.lab_down(lab_id, sd, known)


def report(res: dict, delay_ms: int, runs: int) -> str:
    lines = [f"fleetctl inspect vs the grep habit: delay {delay_ms} ms each way ({2 * delay_ms} ms RTT), "
             f"{runs} alternating runs, medians; control machine: {os.cpu_count()} CPUs, load average "
             f"{os.getloadavg()[0]:.1f} at the end (shared with other work: absolute times are inflated)"]
    for r in res["sizes"]:
        n = r["hosts"]
        base = r["median_wall_s"]["raw OpenSSH grep"]
        lines.append(f"\n{n} hosts (lab up took {r['lab_up_s']} s)")
        lines.append(f"  {'':40s} {'wall s':>8s} {'x raw':>7s} {'ctl CPU s':>10s} {'CPU s/host':>10s} "
                     f"{'peak RSS MiB':>12s}")
        for k, w in r["median_wall_s"].items():
            cpu, rss = r["median_cpu_s"][k], r["median_rss_kb"][k] / 1024
            failed = sum(1 for x in r["raw"][k] if x["rc"] != 0)
            lines.append(f"  {k:40s} {w:8.2f} {w / base:7.2f} {cpu:10.2f} {cpu / n:10.3f} {rss:12.1f}"
                         + (f"  ({failed} of {len(r['raw'][k])} runs failed)" if failed else ""))
        s = r["single_median_s"]
        g, f = s["ssh grep -rl (one 0.5.23 host)"], s["fleetctl warm (one 0.5.23 host)"]
        start, py = s["floor: fleetctl's start, no host"], s["floor: ssh HOST python -S -c pass"]
        named = s["fleetctl warm, named interpreter (one 0.5.23 host)"]
        lines.append(f"  one 0.5.23 host: ssh grep -rl {g:.2f} s, fleetctl warm {f:.2f} s: {f / g:.2f}x "
                     f"(named interpreter {named:.2f} s: {named / g:.2f}x; timing "
                     f"{r['warm_named_probe_0.5.23']['timing']}); floors: "
                     f"fleetctl's start (imports, no host) {start:.2f} s, ssh HOST python -S -c pass {py:.2f} s")
        c = r["cold_probe_0.5.23"]
        lines.append(f"  cold probe scan on 0.5.23: {c['scan']['elapsed_s']} s, phases {c['scan']['phases_s']}; "
                     f"grep -rl on the host: {r['remote_grep_rl_s']:.2f} s: "
                     f"{c['scan']['elapsed_s'] / r['remote_grep_rl_s']:.2f}x; timing {c['timing']}")
        w = r["warm_probe_0.5.23"]
        lines.append(f"  warm probe scan on 0.5.23: {w['scan']['elapsed_s']} s, phases {w['scan']['phases_s']}, "
                     f"cache {w['scan']['cache']['hits']} hits / {w['scan']['cache']['misses']} misses; "
                     f"timing {w['timing']}")
    if len(res["sizes"]) > 1:
        a, b = res["sizes"][0], res["sizes"][-1]
        for k in ("raw OpenSSH grep", "fleetctl warm (paramiko)", "fleetctl cold (paramiko)", "floor: OpenSSH starting Python -S"):
            lines.append(f"{b['hosts']} vs {a['hosts']} hosts, {k}: "
                         f"{b['median_wall_s'][k] / a['median_wall_s'][k]:.2f}x")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--delay-ms", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--lab-id", type=int, default=33)
    ap.add_argument("--out", type=Path, help="write the raw results (JSON) and the report (.txt) here")
    ap.add_argument("--keep", action="store_true", help="leave the labs up afterwards")
    ap.add_argument("--baseline-agent", type=Path, help="an older checkout's agent/ directory: its fleetctl runs "
                                                        "the named-interpreter line too (paired)")
    a = ap.parse_args()
    env = dict(os.environ)
    res = {"delay_ms": a.delay_ms, "runs": a.runs, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "sizes": []}
    for i, n in enumerate(a.hosts):
        res["sizes"].append(fleet_run(n, a, a.lab_id + i, env))
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(res, indent=1) + "\n")
        text = report(res, a.delay_ms, a.runs)
        if a.out:
            a.out.with_suffix(".txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
