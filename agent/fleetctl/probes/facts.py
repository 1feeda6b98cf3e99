"""Inspect probe: facts about one host and the KV pool allocator call sites of its SGLang.

Runs on the host, stdlib only (Python 3.8+), sent by fleetctl over SSH stdin. One round trip:
it finds the interpreter that runs SGLang, re-runs itself under that interpreter when it is not
the one it was started with, and returns every fact as plain JSON data.

Interpreter order: the inventory's ansible_python_interpreter / fleetctl_python (params["python"]);
else a running SGLang server's interpreter; else python3 on PATH and common venv locations.
A candidate has SGLang when its site directories hold an `sglang` distribution
(importlib.metadata on those paths): nothing is imported, and no candidate is run to find out.
"""

import glob
import json
import os
import socket
import subprocess
import sys
import time

if __package__:  # imported from the fleetctl package
    from . import redact
else:
    import redact  # loaded before this module by the probe bundle

DEFAULT_PORT = 30000  # sglang/srt/server_args.py: ServerArgs.port
COMMON_PYTHONS = [
    "/opt/*/venv/bin/python", "/opt/*/.venv/bin/python", "/opt/venv/bin/python",
    "/opt/conda/bin/python", "/opt/conda/envs/*/bin/python", "/root/.venv/bin/python",
    "/root/venv/bin/python", "/home/*/.venv/bin/python", "/home/*/venv/bin/python",
    "/workspace/*/.venv/bin/python", "/usr/local/bin/python3", "/usr/bin/python3",
]
NVIDIA_SMI_QUERY = "index,name,memory.total,driver_version,compute_cap"


def _read(path, mode="r"):
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return None


# ---- running servers ---------------------------------------------------------------------

def _opt(argv, *names):
    """Value of the first of `names` in argv (`--name V` or `--name=V`), else None."""
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(n + "="):
                return a[len(n) + 1:]
    return None


def server_kind(argv):
    """'launch_server', 'serve', 'stand-in' or None for a process's argv."""
    for i, a in enumerate(argv):
        if a == "-m" and i + 1 < len(argv) and argv[i + 1] == "sglang.launch_server":
            return "launch_server"
        if os.path.basename(a) == "sglang" and i + 1 < len(argv) and argv[i + 1] == "serve":
            return "serve"
        if a.endswith("fleetctl-standin/server.py"):
            return "stand-in"
    return None


def _proc_table():
    """{pid: (argv, ppid)} for processes in this mount namespace; count of others."""
    own_mnt = os.readlink("/proc/self/ns/mnt") if os.path.exists("/proc/self/ns/mnt") else None
    table, others = {}, 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        raw = _read("/proc/%s/cmdline" % d, "rb")
        stat = _read("/proc/%s/stat" % d)
        if not raw or not stat:
            continue
        try:
            mnt = os.readlink("/proc/%s/ns/mnt" % d)
        except OSError:
            mnt = own_mnt
        argv = [a.decode("utf-8", "replace") for a in raw.rstrip(b"\0").split(b"\0")]
        if own_mnt is not None and mnt != own_mnt:
            if server_kind(argv):
                others += 1
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        table[int(d)] = (argv, ppid)
    return table, others


def _interpreter_of(pid, argv):
    """The python a server runs under: argv[0] if it is a python, the script's shebang, VIRTUAL_ENV."""
    first = argv[0]
    if os.path.basename(first).startswith("python") and os.path.isabs(first):
        return first
    for a in argv[:2]:
        if os.path.basename(a) == "sglang" and os.path.isabs(a):
            head = (_read(a) or "").split("\n", 1)[0]
            if head.startswith("#!"):
                return head[2:].strip().split()[0]
    env = _read("/proc/%d/environ" % pid, "rb") or b""
    for item in env.split(b"\0"):
        if item.startswith(b"VIRTUAL_ENV="):
            return os.path.join(item[12:].decode(), "bin", "python")
    try:
        return os.readlink("/proc/%d/exe" % pid)
    except OSError:
        return None


def find_servers():
    """Running SGLang servers: `python -m sglang.launch_server`, `sglang serve`, the lab stand-in,
    and `sglang::scheduler*` processes followed up to their parent server.

    Returns ([{pid, argv, kind, port, host, model_path, tp_size, python}], count of servers seen
    in other mount namespaces (containers), which are not reported). Flags per
    sglang/srt/server_args.py (--port default 30000, --model-path, --tp-size). Secrets in argv
    (--api-key, tokens, URL passwords) are redacted here, before they leave the host (redact.py).
    """
    table, others = _proc_table()
    pids = {pid for pid, (argv, _) in table.items() if server_kind(argv)}
    for pid, (argv, ppid) in table.items():
        if argv and argv[0].startswith("sglang::scheduler"):
            p, seen = ppid, set()
            while p in table and p not in seen and p > 1:
                seen.add(p)
                if server_kind(table[p][0]):
                    break
                p = table[p][1]
            else:
                p = None
            if p is not None and p in table:
                pids.add(p)
    servers = []
    for pid in sorted(pids):
        argv = redact.argv(table[pid][0])
        port = _opt(argv, "--port")
        tp = _opt(argv, "--tp-size", "--tp", "--tensor-parallel-size")
        servers.append({
            "pid": pid, "argv": argv, "kind": server_kind(argv) or "unknown",
            "port": int(port) if port and port.isdigit() else DEFAULT_PORT,
            "host": _opt(argv, "--host") or "127.0.0.1",
            "model_path": _opt(argv, "--model-path", "--model"),
            "tp_size": int(tp) if tp and tp.isdigit() else 1,
            "python": _interpreter_of(pid, argv),
        })
    return servers, others


# ---- interpreters ------------------------------------------------------------------------

def site_dirs(python):
    """Site directories of interpreter path `python`, read from its layout and pyvenv.cfg."""
    prefix = os.path.dirname(os.path.dirname(python))
    pats = ["lib/python3*/site-packages", "lib/python3*/dist-packages", "local/lib/python3*/dist-packages"]
    dirs = [d for p in pats for d in sorted(glob.glob(os.path.join(prefix, p)))]
    cfg = _read(os.path.join(prefix, "pyvenv.cfg")) or ""
    conf = dict((k.strip(), v.strip()) for k, _, v in
                (line.partition("=") for line in cfg.splitlines()) if _)
    if conf.get("include-system-site-packages", "false").lower() == "true" and conf.get("home"):
        base = os.path.dirname(conf["home"])
        dirs += [d for p in pats for d in sorted(glob.glob(os.path.join(base, p)))]
    if prefix == "/usr" or (conf and os.path.dirname(conf.get("home", "")) == "/usr"):
        dirs.append("/usr/lib/python3/dist-packages")
    return dirs


def sglang_in(python):
    """(version, site dir) of the sglang distribution visible to `python`, or None."""
    try:
        from importlib import metadata
    except ImportError:  # Python < 3.8 cannot be the target; treated as "no sglang"
        return None
    if os.path.realpath(sys.prefix) == os.path.realpath(os.path.dirname(os.path.dirname(python))):
        path = sys.path
    else:
        path = site_dirs(python)
    for dist in metadata.distributions(name="sglang", path=path):
        return dist.version, str(dist.locate_file(""))
    return None


def untrusted(python):
    """Why `python` must not be run as root by fleetctl, or None (review M6).

    Everything that runs when it starts must belong to root (or this user) and be writable by
    nobody else: the real interpreter, its bin/ directory, its prefix, each site directory (and
    its parents up to the prefix), and each `.pth`, sitecustomize and usercustomize file there
    (site.py executes `.pth` import lines at startup). Otherwise another local user could plant
    code that root runs."""
    prefix = os.path.dirname(os.path.dirname(python))
    paths = [os.path.realpath(python), os.path.dirname(python), prefix]
    for d in site_dirs(python):
        up = d
        while up.startswith(prefix + "/") and up not in paths:
            paths.append(up)
            up = os.path.dirname(up)
        if not d.startswith(prefix + "/"):
            paths.append(d)
        paths += sorted(glob.glob(os.path.join(glob.escape(d), "*.pth")))
        paths += [p for p in (os.path.join(d, n) for n in ("sitecustomize.py", "usercustomize.py"))
                  if os.path.lexists(p)]
    for path in paths:
        try:
            st = os.stat(path)
        except OSError as e:
            return "cannot stat %s: %s" % (path, e.strerror)
        if st.st_uid not in (0, os.geteuid()):
            return "%s belongs to uid %d" % (path, st.st_uid)
        if st.st_mode & 0o022:
            return "%s is writable by group or others" % path
    return None


def choose_interpreter(servers):
    """The interpreter that runs SGLang here: (path, reason, [candidates considered])."""
    candidates = []
    for s in servers:
        if s["python"]:
            candidates.append((s["python"], "running server pid %d" % s["pid"]))
    for d in os.environ.get("PATH", "/usr/bin").split(os.pathsep):
        p = os.path.join(d, "python3")
        if os.path.exists(p):
            candidates.append((p, "python3 on PATH"))
            break
    for pat in COMMON_PYTHONS:
        for p in sorted(glob.glob(pat)):
            candidates.append((p, "common location"))
    seen, considered = set(), []
    for path, why in candidates:
        if path in seen or not os.access(path, os.X_OK):
            continue
        seen.add(path)
        why_not = untrusted(path)
        if why_not:
            considered.append({"python": path, "reason": why, "sglang": None, "skipped": why_not})
            continue
        found = sglang_in(path)
        considered.append({"python": path, "reason": why, "sglang": found[0] if found else None})
        if found:
            return path, why, considered
    return None, "no interpreter with an sglang distribution found", considered


# ---- facts in the target interpreter -----------------------------------------------------

def torch_facts():
    """torch version and CUDA version from distribution metadata and torch/version.py (no import)."""
    from importlib import metadata
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None
    cuda = None
    text = _read(str(dist.locate_file("torch/version.py"))) or ""
    import ast
    try:
        for node in ast.parse(text).body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if isinstance(target, ast.Name) and target.id == "cuda" and isinstance(node.value, ast.Constant):
                cuda = node.value.value
    except SyntaxError:
        pass
    return {"version": dist.version, "cuda": cuda}


def gpu_facts(timeout=20):
    """GPUs from `nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_cap
    --format=csv,noheader,nounits`: ([{index, name, memory_total_mib, driver, compute_cap}], reason)."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=" + NVIDIA_SMI_QUERY, "--format=csv,noheader,nounits"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    except FileNotFoundError:
        return [], "nvidia-smi not found"
    except subprocess.TimeoutExpired:
        return [], "nvidia-smi did not answer within %d s" % timeout
    if r.returncode != 0:
        return [], "nvidia-smi failed (exit %d): %s" % (r.returncode, r.stderr.decode(errors="replace").strip()[-300:])
    gpus = []
    for line in r.stdout.decode().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        idx, name, mem, driver, cap = parts
        gpus.append({"index": int(idx), "name": name,
                     "memory_total_mib": int(mem) if mem.isdigit() else None,
                     "driver": driver, "compute_cap": cap})
    return gpus, None


def collect(params, servers, others, discovery):
    """All inspect facts, gathered inside the interpreter that runs SGLang."""
    from importlib import metadata
    try:
        dist = metadata.distribution("sglang")
        sglang = {"version": dist.version, "location": str(dist.locate_file(""))}
    except metadata.PackageNotFoundError:
        sglang = None
    gpus, gpu_reason = gpu_facts()
    facts = {
        "hostname": socket.gethostname(),
        "python": {"path": params.get("python") or sys.executable,
                   "version": "%d.%d.%d" % sys.version_info[:3]},
        "sglang": sglang,
        "torch": torch_facts(),
        "gpus": gpus,
        "gpus_reason": gpu_reason,
        "servers": servers,
        "servers_in_other_namespaces": others,
        "interpreter_discovery": discovery,
    }
    out = {"facts": facts, "allocator_call_sites": [], "need_sort_origins": [], "scan": None}
    if sglang and params.get("scan", True):
        import callsites  # loaded before this module by the probe bundle
        t0 = time.time()
        found = callsites.scan(sglang["location"])
        out["allocator_call_sites"] = found.pop("allocator_call_sites")
        out["need_sort_origins"] = found.pop("need_sort_origins")
        found["elapsed_s"] = round(time.time() - t0, 3)
        out["scan"] = found
        if params.get("with_sources"):
            files = sorted({o["file"] for o in out["need_sort_origins"]})
            out["sources"] = {}
            for f in files:  # exact text: bytes decoded, no newline translation (sha256 must match)
                raw = _read(os.path.join(sglang["location"], f), "rb")
                try:
                    out["sources"][f] = raw.decode("utf-8") if raw is not None else None
                except UnicodeDecodeError:
                    out["sources"][f] = None  # not UTF-8: planning refuses this file, inspect goes on
    return out


def main(params):
    """params: python (str|None, inventory interpreter), scan (bool), with_sources (bool).
    Returns {"facts", "allocator_call_sites", "need_sort_origins", "scan", ["sources"]}."""
    servers, others = find_servers()
    if params.get("python") or params.get("in_target"):
        discovery = params.get("discovery") or {"python": params.get("python"), "reason": "inventory"}
        return collect(params, servers, others, discovery)
    target, reason, considered = choose_interpreter(servers)
    discovery = {"python": target, "reason": reason, "considered": considered}
    if target is None or os.path.realpath(sys.prefix) == os.path.realpath(os.path.dirname(os.path.dirname(target))):
        params = dict(params, python=target or sys.executable)
        return collect(params, servers, others, discovery)
    doc = json.loads(FLEETCTL_BUNDLE)  # noqa: F821 (set by the probe wrapper)
    doc["params"] = dict(params, in_target=True, python=target, discovery=discovery)
    r = subprocess.run([target, "-c", FLEETCTL_WRAPPER], input=json.dumps(doc).encode(),  # noqa: F821
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    text = r.stdout.decode("utf-8", "replace")
    marker = "--fleetctl-probe-result--\n"
    if marker not in text:
        raise RuntimeError("interpreter %s printed no result (exit %d): %s"
                           % (target, r.returncode, r.stderr.decode("utf-8", "replace")[-1500:]))
    return json.loads(text[text.rfind(marker) + len(marker):])
