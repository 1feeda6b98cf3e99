"""Benchmark: `fleetctl inspect all` against the grep habit and its peers (issues 18, 55).

Everything runs in one go, alternating (round robin, medians), against the same lab hosts (real
sshd in network namespaces, releases round robin) with the same added latency (`fleetctl lab
fault HOST delay D`: the lab's userspace delay proxy holds each chunk D ms each way; D=10 is
"20 ms RTT"). Per fleet size (16, 64 and 256 hosts by default):

  raw OpenSSH grep       xargs -P N ssh HOST "<DESIGN.md's one-line grep>"  (fresh connections)
  raw OpenSSH, masters   the same over live ControlPersist masters opened beforehand (reference)
  Fabric grep            fabric.ThreadingGroup(...).run(grep)
  Ansible ad-hoc grep    ansible all -m shell -a "<grep>" -f N  (its default ssh ControlPersist;
                         only up to --ansible-max hosts: 167 s a run at 64 hosts)
  pyinfra fact grep      pyinfra HOSTS fact server.Command command="<grep>" --parallel N (issue 55)
  fleetctl cold          `cache clear all` (not timed), then `inspect all --json` (paramiko)
  fleetctl warm          `inspect all --json` (paramiko): only the hosts' scan caches are warm
  fleetctl ssh           `inspect all --json -c ssh` (OpenSSH, per-run masters)
  fleetctl ssh, live     the same with an ssh_config whose ControlPath names the live masters
                         above (an operator's own ControlMaster setup): no connection is made
  floor: Python -S       xargs -P N ssh HOST "<the interpreter fleetctl recorded> -S -c pass": what
                         any Python probe costs before it does anything (fresh connections)

plus, on one 0.5.23 host: `ssh HOST grep -rl -e TokenToKVPoolAllocator -e need_sort <package>`
against a warm `fleetctl inspect HOST`, with two floors: fleetctl's start on this machine (its
imports, no host) and `ssh HOST <interpreter> -S -c pass`; and the cold probe's scan phases
against that grep's own time on the host. fleetctl's modules are byte-compiled first, as pip
compiles an installed package (a checkout under PYTHONDONTWRITEBYTECODE=1 would compile them in
every timed run). The control process's CPU seconds (user+sys) and peak RSS come from
/usr/bin/time; the most open file descriptors and threads of the control's process tree (the
command and every process under it, summed) from /proc, sampled every SAMPLE_S. Host keys are
verified by every client (known_hosts written by the lab).

More than LAB_HOSTS hosts are spread over several labs (one bridge and /24 each: a lab id per
LAB_HOSTS hosts), sharing one client key and one known_hosts; their inventories merged, each host
renamed `l<lab id>-<name>`. --lines picks the lines (default: the issue 55 set).

Usage (root):  python bench/inspect_vs_ssh.py [--hosts 16 64 256] [--delay-ms 10] [--runs 3]
               [--lab-id 33] [--out bench/results/NAME.json] [--lines NAME...] [--ansible-max 64]
Lab ids lab_id, lab_id+1, ... are used (one per LAB_HOSTS hosts of each fleet size) and taken down
afterwards (unless --keep). Fabric, ansible-core and pyinfra: bench/requirements.txt.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
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
# Python started as fleetctl's probe starts it (the interpreter recorded on the host, no site), doing nothing
PY_FLOOR = 'read -r p < /var/lib/fleetctl/scan-cache/interpreter && exec "$p" -S -c pass'
# fleetctl's start on this machine without a host: the modules `inspect` imports
START = "import fleetctl.cli, fleetctl.engine.gather, fleetctl.connection.paramiko_ssh"
LAB_HOSTS = 128  # hosts per lab (a Linux bridge takes 1,024 ports; a lab's /24 holds 244)
SAMPLE_S = 0.2
LINES = ["raw OpenSSH grep", "Fabric grep", "Ansible ad-hoc grep", "pyinfra fact grep", "fleetctl cold (paramiko)",
         "fleetctl warm (paramiko)", "floor: OpenSSH starting Python -S"]
FABRIC = """
import sys
from fabric import ThreadingGroup
hosts, key, cmd = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
g = ThreadingGroup(*hosts, user="root", connect_kwargs={"key_filename": key, "look_for_keys": False})
res = g.run(cmd, hide=True, warn=True)
sys.exit(0 if len(res) == len(hosts) and not res.failed else 1)
"""


def _tree_counts(root: int) -> tuple[int, int]:
    """(open descriptors, threads) of process `root` and every process under it, from /proc."""
    parent, threads = {}, {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            parent[int(d)], threads[int(d)] = int(fields[1]), int(fields[17])
    tree, frontier = {root}, [root]
    children: dict[int, list[int]] = {}
    for pid, pp in parent.items():
        children.setdefault(pp, []).append(pid)
    while frontier:
        for c in children.get(frontier.pop(), []):
            if c not in tree:
                tree.add(c)
                frontier.append(c)
    fds = 0
    for pid in tree:
        try:
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            pass
    return fds, sum(threads.get(pid, 0) for pid in tree)


def timed(cmd: list[str], env: dict, stdin: str | None = None) -> dict:
    """Run `cmd` under /usr/bin/time: {wall_s, cpu_s (user+sys of it and its children), rss_kb,
    max_fds, max_threads (of its process tree, sampled: _tree_counts), rc, out, err}."""
    with tempfile.NamedTemporaryFile("r") as tf:
        t0 = time.perf_counter()
        p = subprocess.Popen(["/usr/bin/time", "-o", tf.name, "-f", "%U %S %M", *cmd], env=env, text=True,
                             stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        most = [0, 0]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(SAMPLE_S):
                fds, threads = _tree_counts(p.pid)
                most[0], most[1] = max(most[0], fds), max(most[1], threads)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            out, err = p.communicate(stdin, timeout=1800)
        finally:
            done.set()
            sampler.join()
        wall = time.perf_counter() - t0
        u, s, m = tf.read().split()[-3:]
    return {"wall_s": wall, "cpu_s": float(u) + float(s), "rss_kb": int(m), "max_fds": most[0],
            "max_threads": most[1], "rc": p.returncode, "out": out, "err": err[-3000:]}


def check(name: str, r: dict) -> dict:
    if r["rc"] != 0:
        raise SystemExit(f"{name} failed (exit {r['rc']}): {r['out'][-3000:]} {r['err']}")
    return r


def labs_up(n: int, lab_ids: list[int], known: Path, home: Path) -> tuple[Path, list[tuple[int, dict]]]:
    """`n` hosts over labs `lab_ids` (as even as can be), one client key (the first lab's) and
    one known_hosts `known`: (the merged inventory, [(lab id, lab_status host)])."""
    merged: dict = {"all": {"children": {"lab": {"hosts": {}, "children": {}}}}}
    hosts = []
    first = lab.state_dir_for(lab_ids[0])
    for k, lab_id in enumerate(lab_ids):
        size = n // len(lab_ids) + (1 if k < n % len(lab_ids) else 0)
        sd = lab.state_dir_for(lab_id)
        if k:  # the first lab's client key, kept by lab_up when present
            sd.mkdir(parents=True, exist_ok=True)
            for f in ("client_ed25519", "client_ed25519.pub"):
                (sd / f).write_bytes((first / f).read_bytes())
            (sd / "client_ed25519").chmod(0o600)
        inv = lab.lab_up(size, lab.DEFAULT_RELEASES, lab_id=lab_id, state_dir=sd, known_hosts=known)
        doc = yaml.safe_load(Path(inv).read_text())["all"]["children"]["lab"]
        rename = (lambda name, lab_id=lab_id: name) if len(lab_ids) == 1 else \
            (lambda name, lab_id=lab_id: f"l{lab_id}-{name}")
        for name, v in doc["hosts"].items():
            merged["all"]["children"]["lab"]["hosts"][rename(name)] = v
        for group, g in doc["children"].items():
            merged["all"]["children"]["lab"]["children"].setdefault(group, {"hosts": {}})["hosts"].update(
                {rename(name): None for name in g["hosts"]})
        hosts += [(lab_id, dict(h, name=rename(h["name"]), lab_name=h["name"])) for h in lab.lab_status(lab_id, sd)]
    out = home / "hosts.yaml"
    out.write_text(yaml.safe_dump(merged, sort_keys=False))
    return out, hosts


def fleet_run(n: int, a, lab_ids: list[int], base_env: dict) -> dict:
    """One fleet size: labs up, faults, alternating runs; returns the raw timings and medians."""
    runs = dict((int(k), int(v)) for k, v in (x.split("=") for x in a.runs_at)).get(n, a.runs)
    home = Path(tempfile.mkdtemp(prefix="fleetctl-bench-"))
    known = home / ".ssh" / "known_hosts"
    sd = lab.state_dir_for(lab_ids[0])
    t0 = time.time()
    try:
        inv, lab_hosts = labs_up(n, lab_ids, known, home)
    except BaseException:
        for lab_id in lab_ids:
            lab.lab_down(lab_id, lab.state_dir_for(lab_id), known)
        raise
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
    cp = home / "cp"
    cp.mkdir(mode=0o700)
    masters_config = home / "ssh_config_masters"
    masters_config.write_text(f"Host *\n  ControlMaster auto\n  ControlPath {cp}/%C\n  ControlPersist 600\n"
                              f"  UserKnownHostsFile {known}\n")
    try:
        for lab_id, h in lab_hosts:
            lab.lab_fault(h["lab_name"], "delay", a.delay_ms, lab_id=lab_id, state_dir=lab.state_dir_for(lab_id))
        hosts = [h for _, h in lab_hosts]
        addrs = [h["address"] for h in hosts]
        one = next(h for h in hosts if h["release"] == "0.5.23")
        ssh = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known}",
               "-i", key, "-o", "IdentitiesOnly=yes"]
        master = [*ssh, "-o", f"ControlPath={cp}/%C", "-o", "ControlMaster=auto", "-o", "ControlPersist=600"]
        xargs = ["xargs", "-P", str(n), "-I{}", "timeout", "120"]
        pyinfra_inv = home / "pyinfra_inventory.py"  # a comma list of 64 addresses is over NAME_MAX for its Path check
        pyinfra_inv.write_text(f"lab = {addrs!r}\n")
        pyinfra = ["pyinfra", str(pyinfra_inv), "fact", "server.Command", f"command={GREP}", "--user", "root",
                   "--key", key, "--parallel", str(n), "-y", "--data", f"ssh_known_hosts_file={known}",
                   "--data", "ssh_strict_host_key_checking=yes"]
        cmds = {
            "raw OpenSSH grep": ([*xargs, *ssh, "root@{}", GREP], "\n".join(addrs) + "\n"),
            "raw OpenSSH grep, live masters": ([*xargs, *master, "root@{}", GREP], "\n".join(addrs) + "\n"),
            "Fabric grep": ([sys.executable, "-c", FABRIC, ",".join(addrs), key, GREP], None),
            "Ansible ad-hoc grep": (["ansible", "all", "-i", str(inv), "-m", "shell", "-a", GREP, "-f", str(n)],
                                    None),
            "pyinfra fact grep": (pyinfra, None),
            "fleetctl cold (paramiko)": ([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "--json", *CT], None),
            "fleetctl warm (paramiko)": ([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "--json", *CT], None),
            "fleetctl warm (ssh, per-run masters)": ([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "--json",
                                                      "-c", "ssh", *CT], None),
            "fleetctl warm (ssh, live masters)": ([sys.executable, "-m", "fleetctl.cli", "inspect", "all", "--json",
                                                   "-c", "ssh", *CT], None),
            "floor: OpenSSH starting Python -S": ([*xargs, *ssh, "root@{}", PY_FLOOR], "\n".join(addrs) + "\n"),
        }
        cmds = {k: v for k, v in cmds.items() if k in a.lines and not (k.startswith("Ansible") and n > a.ansible_max)
                and not (k.startswith("fleetctl cold") and n > a.cold_max)}
        if "raw OpenSSH grep, live masters" in cmds or "fleetctl warm (ssh, live masters)" in cmds:
            for addr in addrs:  # live masters for the reference lines
                subprocess.run([*master, "-M", "-N", "-f", f"root@{addr}"], check=True, timeout=120,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # the operator's own ControlMaster setup, whose masters (opened above) are live
        masters_env = dict(env, FLEETCTL_SSH_CONFIG=str(masters_config))
        clear = [sys.executable, "-m", "fleetctl.cli", "cache", "clear", "all", "--json", *CT]
        warm = [sys.executable, "-m", "fleetctl.cli", "inspect", "all", "--json", *CT]
        check("warm-up inspect", timed(warm, env))  # every host's interpreter recorded: the floor's line reads it
        raw: dict[str, list[dict]] = {k: [] for k in cmds}
        docs = {}
        for _ in range(runs):
            for name, (cmd, stdin) in cmds.items():
                if name.startswith("fleetctl cold"):
                    check("cache clear", timed(clear, env))
                r = timed(cmd, masters_env if "live masters" in name else env, stdin)
                if name.startswith("fleetctl"):
                    docs[name] = json.loads(check(name, r)["out"])
                    r["not_ok"] = sum(1 for h in docs[name]["hosts"] if h.get("status") != "ok")
                elif r["rc"] != 0:  # a peer's failed run is kept (and said), not the end of the benchmark
                    print(f"{name} failed (exit {r['rc']}): {r['out'][-1500:]} {r['err'][-1500:]}", file=sys.stderr)
                raw[name].append({k: r[k] for k in ("wall_s", "cpu_s", "rss_kb", "max_fds", "max_threads", "rc")
                                  if k in r} | ({"not_ok": r["not_ok"]} if "not_ok" in r else {}))
                print(f"{n} hosts, {name}: {r['wall_s']:.2f} s, rc {r['rc']}", file=sys.stderr, flush=True)
        # one host: grep -rl over the package, against a warm inspect of that host
        single = {"ssh grep -rl (one 0.5.23 host)": [], "fleetctl warm (one 0.5.23 host)": [],
                  "floor: fleetctl's start, no host": [], "floor: ssh HOST python -S -c pass": []}
        remote_grep = []
        for _ in range(runs):
            r = check("grep -rl", timed([*ssh, f"root@{one['address']}", GREP_RL], env))
            single["ssh grep -rl (one 0.5.23 host)"].append(r["wall_s"])
            r = check("inspect one", timed([sys.executable, "-m", "fleetctl.cli", "inspect", one["name"], "--json", *CT], env))
            single["fleetctl warm (one 0.5.23 host)"].append(r["wall_s"])
            r = check("fleetctl start", timed([sys.executable, "-c", START], env))
            single["floor: fleetctl's start, no host"].append(r["wall_s"])
            r = check("python floor", timed([*ssh, f"root@{one['address']}", PY_FLOOR], env))
            single["floor: ssh HOST python -S -c pass"].append(r["wall_s"])
            r = check("remote grep time", timed(
                [*ssh, f"root@{one['address']}", "bash -c " + shlex.quote(f"TIMEFORMAT=%R; time {GREP_RL} >/dev/null")],
                env))
            remote_grep.append(float(r["err"].strip().splitlines()[-1]))
        def one_of(line: str) -> dict:
            return next((h for h in docs.get(line, {}).get("hosts", []) if h["host"] == one["name"]),
                        {"scan": {k: None for k in ("elapsed_s", "phases_s", "cache", "stats")}})
        cold_one, warm_one = one_of("fleetctl cold (paramiko)"), one_of("fleetctl warm (paramiko)")
        if "raw OpenSSH grep, live masters" in cmds or "fleetctl warm (ssh, live masters)" in cmds:
            for addr in addrs:
                subprocess.run([*master, "-O", "exit", f"root@{addr}"], capture_output=True, timeout=30)
        return {
            "hosts": n, "runs": runs, "lab_up_s": round(up_s, 1), "raw": raw, "single": single,
            "median_wall_s": {k: statistics.median(x["wall_s"] for x in v) for k, v in raw.items()},
            "median_cpu_s": {k: statistics.median(x["cpu_s"] for x in v) for k, v in raw.items()},
            "median_rss_kb": {k: statistics.median(x["rss_kb"] for x in v) for k, v in raw.items()},
            "max_fds": {k: max(x["max_fds"] for x in v) for k, v in raw.items()},
            "max_threads": {k: max(x["max_threads"] for x in v) for k, v in raw.items()},
            "not_ok": {k: max(x.get("not_ok", 0) for x in v) for k, v in raw.items()},
            "load": os.getloadavg(),
            "single_median_s": {k: statistics.median(v) for k, v in single.items()},
            "remote_grep_rl_s": statistics.median(remote_grep),
            "cold_probe_0.5.23": {"scan": {k: cold_one["scan"][k] for k in ("elapsed_s", "phases_s", "cache", "stats")},
                                  "timing": cold_one.get("timing")},
            "warm_probe_0.5.23": {"scan": {k: warm_one["scan"][k] for k in ("elapsed_s", "phases_s", "cache")},
                                  "timing": warm_one.get("timing")},
        }
    finally:
        if not a.keep:
            for lab_id in lab_ids:
                lab.lab_down(lab_id, lab.state_dir_for(lab_id), known)


FLOOR = "floor: OpenSSH starting Python -S"


def report(res: dict, delay_ms: int, runs: int) -> str:
    lines = [f"fleetctl inspect vs the grep habit: delay {delay_ms} ms each way ({2 * delay_ms} ms RTT), "
             f"alternating runs (per size below), medians; control machine: {os.cpu_count()} CPUs, shared with other "
             "work (load averages per size below: absolute times are inflated, ratios within a size are the figure)"]
    for r in res["sizes"]:
        n = r["hosts"]
        base, floor = r["median_wall_s"].get("raw OpenSSH grep"), r["median_wall_s"].get(FLOOR)
        lines.append(f"\n{n} hosts, {r['runs']} runs (labs {r.get('lab_ids')}, up in {r['lab_up_s']} s; load average at the end "
                     f"{' '.join(f'{x:.1f}' for x in r.get('load', []))})")
        lines.append(f"  {'':36s} {'wall s':>7s} {'x raw':>6s} {'x floor':>7s} {'ctl CPU s':>9s} {'ms/host':>7s} "
                     f"{'RSS MiB':>7s} {'max fds':>7s} {'threads':>7s} {'not ok':>6s}")
        for k, w in r["median_wall_s"].items():
            cpu, rss = r["median_cpu_s"][k], r["median_rss_kb"][k] / 1024
            failed = sum(1 for x in r["raw"][k] if x["rc"] != 0)
            lines.append(f"  {k:36s} {w:7.2f} {w / base if base else 0:6.2f} {w / floor if floor else 0:7.2f} "
                         f"{cpu:9.2f} {1000 * cpu / n:7.1f} {rss:7.1f} {r['max_fds'][k]:7d} {r['max_threads'][k]:7d} "
                         f"{r['not_ok'][k]:6d}" + (f"  ({failed} of {len(r['raw'][k])} runs failed)" if failed else ""))
        s = r["single_median_s"]
        g, f = s["ssh grep -rl (one 0.5.23 host)"], s["fleetctl warm (one 0.5.23 host)"]
        start, py = s["floor: fleetctl's start, no host"], s["floor: ssh HOST python -S -c pass"]
        lines.append(f"  one 0.5.23 host: ssh grep -rl {g:.2f} s, fleetctl warm {f:.2f} s: {f / g:.2f}x; floors: "
                     f"fleetctl's start (imports, no host) {start:.2f} s, ssh HOST python -S -c pass {py:.2f} s")
        c = r["cold_probe_0.5.23"]
        if c["scan"]["elapsed_s"]:
            lines.append(f"  cold probe scan on 0.5.23 (in the fleet's cold run): {c['scan']['elapsed_s']} s, phases "
                         f"{c['scan']['phases_s']}; grep -rl on the host alone: {r['remote_grep_rl_s']:.2f} s; "
                         f"timing {c['timing']}")
        w = r["warm_probe_0.5.23"]
        if w["scan"]["elapsed_s"]:
            lines.append(f"  warm probe scan on 0.5.23: {w['scan']['elapsed_s']} s, phases {w['scan']['phases_s']}, "
                         f"cache {w['scan']['cache']['hits']} hits / {w['scan']['cache']['misses']} misses")
    sizes = res["sizes"]
    for a, b in zip(sizes, sizes[1:]):
        fa, fb = a["median_wall_s"].get(FLOOR), b["median_wall_s"].get(FLOOR)
        for k in b["median_wall_s"]:
            if k in a["median_wall_s"]:
                g = b["median_wall_s"][k] / a["median_wall_s"][k]
                lines.append(f"{b['hosts']} vs {a['hosts']} hosts, {k}: {g:.2f}x"
                             + (f" ({g / (fb / fa):.2f}x the floor's growth)" if fa and fb and k != FLOOR else ""))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--delay-ms", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--runs-at", nargs="*", default=[], metavar="HOSTS=RUNS",
                    help="fewer (or more) runs at one fleet size, e.g. 256=2 (its lines are minutes each)")
    ap.add_argument("--lab-id", type=int, default=33)
    ap.add_argument("--lines", nargs="+", default=LINES, help="the lines to run (names as in the report)")
    ap.add_argument("--ansible-max", type=int, default=64, help="no Ansible line above this many hosts")
    ap.add_argument("--cold-max", type=int, default=1024, help="no fleetctl cold line above this many hosts")
    ap.add_argument("--lab-hosts", type=int, default=LAB_HOSTS, help="hosts per lab (several labs above it)")
    ap.add_argument("--out", type=Path, help="write the raw results (JSON) and the report (.txt) here")
    ap.add_argument("--keep", action="store_true", help="leave the labs up afterwards")
    ap.add_argument("--report-of", nargs="+", type=Path, metavar="JSON",
                    help="run nothing: the report of these saved results, their sizes in order (to --out)")
    a = ap.parse_args()
    if a.report_of:
        docs = [json.loads(p.read_text()) for p in a.report_of]
        res = dict(docs[0], sizes=[s for d in docs for s in d["sizes"]], parts=[str(p) for p in a.report_of])
        text = report(res, res["delay_ms"], res["runs"])
        if a.out:
            a.out.write_text(json.dumps(res, indent=1) + "\n")
            a.out.with_suffix(".txt").write_text(text + "\n")
        print(text)
        return 0
    env = dict(os.environ)
    # fleetctl as installed: pip byte-compiles a package at install; a checkout run with
    # PYTHONDONTWRITEBYTECODE=1 would compile every module in every timed run (0.1-0.3 s each)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(__file__).resolve().parents[1] / "agent")],
                   check=True, stdout=subprocess.DEVNULL)
    res = {"delay_ms": a.delay_ms, "runs": a.runs, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "load_at_start": os.getloadavg(), "sizes": []}
    next_id = a.lab_id
    for n in a.hosts:
        ids = list(range(next_id, next_id + math.ceil(n / a.lab_hosts)))
        next_id += len(ids)
        res["sizes"].append(dict(fleet_run(n, a, ids, env), lab_ids=ids))
        text = report(res, a.delay_ms, a.runs)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(res, indent=1) + "\n")
            a.out.with_suffix(".txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
