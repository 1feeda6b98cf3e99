"""Remote probe helper: the SGLang servers running on a host, read from /proc.

Stdlib only (Python 3.8+), loaded by the facts probe bundle. A server is the process that runs
Python itself: its /proc/PID/exe is a python and its own program (what follows the interpreter's
options: `-m MODULE`, or a script) is SGLang's. Wrappers that start it (`conda run`, `uv run`,
`torchrun`, `timeout`, `sudo -u`, `nohup`, `numactl`, `taskset`) carry the same words in their
argv but are not servers: either their exe is no python (timeout, sudo, uv) or their program is
the wrapper's own script (`python .../bin/conda run ...`). One server per process tree: a server
below another server (the DP workers of `sglang_router.launch_server`) is one of its workers,
and `sglang::` titled processes (SGLang's setproctitle names) count under their server.

Facts come from the process itself: its interpreter (argv[0] on its own PATH, else /proc/PID/exe),
its working directory and PYTHONPATH (what its `sys.path` started with), its parallel layout
(tensor, data and pipeline parallel sizes, DP attention, nnodes, node rank, dist-init-addr, read
from its argv: topology.read) and the GPUs it uses (the devices SGLang's launch code gives its
schedulers, under the CUDA_VISIBLE_DEVICES it started with: topology.gpu_ids).
"""

import errno
import os

from . import listeners, pd, topology
from .. import redact, runas, safefs

DEFAULT_PORT = 30000  # sglang/srt/server_args.py: ServerArgs.port
# Python's own options that take a value (python(1), "Command line and environment")
_PY_VALUE_OPTS = "WX"
_PY_LONG_VALUE_OPTS = {"--check-hash-based-pycs"}
MAX_ARG = 4096  # characters kept of one argv item (a string from the host is bounded)


def read(path, mode="r"):
    """The text (bytes for mode "rb") of file `path`, None when it cannot be read or decoded."""
    try:
        with open(path, mode) as f:
            return f.read()
    except (OSError, ValueError):
        return None


def parse_cmdline(raw):
    """The argv of /proc/PID/cmdline bytes `raw` (NUL-separated; each item at most MAX_ARG
    characters), None when it is empty or None (a kernel thread, a zombie, unreadable)."""
    if not raw:
        return None
    return [a.decode("utf-8", "replace")[:MAX_ARG] for a in raw.rstrip(b"\0").split(b"\0")]


def cmdline(pid):
    """Process `pid`'s argv from /proc/PID/cmdline (parse_cmdline), None when it cannot be read
    or is empty."""
    return parse_cmdline(read("/proc/%d/cmdline" % pid, "rb"))


def python_program(argv):
    """Split a Python command line: (flags, kind, target, args). flags: the one-letter options
    given (python(1): "-u -I" -> "uI"; values of -W/-X left out); kind "m" (module), "c"
    (command), "script", "-" (stdin) or None when argv names no program. Clusters such as
    `-um mod` or `-Wignore` are understood."""
    i, flags = 1, ""
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if a in _PY_LONG_VALUE_OPTS:
            i += 2
            continue
        if a.startswith("--"):
            i += 1
            continue
        if a == "-" or not a.startswith("-"):
            break
        takes_next = False
        for j in range(1, len(a)):
            ch = a[j]
            if ch in "mc":
                if a[j + 1:]:
                    return flags, ch, a[j + 1:], argv[i + 1:]
                return flags, ch, (argv[i + 1] if i + 1 < len(argv) else None), argv[i + 2:]
            if ch in _PY_VALUE_OPTS:
                takes_next = not a[j + 1:]
                break
            flags += ch
        i += 2 if takes_next else 1
    if i >= len(argv):
        return flags, None, None, []
    if argv[i] == "-":
        return flags, "-", None, argv[i + 1:]
    return flags, "script", argv[i], argv[i + 1:]


def server_kind(argv):
    """'launch_server', 'serve', 'router', 'pd-router', 'stand-in' or None for a Python process's argv
    (its program only: a wrapper's argv that merely carries these words is no server). A
    'pd-router' is a PD router (pd.role: sglang_router.launch_router --pd-disaggregation, or
    sglang.srt.disaggregation.mini_lb), the front of prefill and decode workers."""
    _, kind, target, args = python_program(argv)
    if kind == "m":
        if target in pd.ROUTER_MODULES:
            return "pd-router" if pd.role(target, args) else None
        return {"sglang.launch_server": "launch_server", "sglang_router.launch_server": "router"}.get(target)
    if kind == "script" and target:
        if os.path.basename(target) == "sglang" and args[:1] == ["serve"]:
            return "serve"
        if target.endswith("fleetctl-standin/server.py"):
            return "stand-in"
    return None


def is_python(pid):
    """True when /proc/PID/exe is a Python interpreter binary (python, python3, python3.11...)."""
    try:
        exe = os.readlink("/proc/%d/exe" % pid)
    except OSError:
        return False
    return os.path.basename(exe).replace(" (deleted)", "").startswith("python")


def parse_environ(raw, names):
    """{name: value} of the variables `names` in /proc/PID/environ bytes `raw` (NUL-separated
    NAME=VALUE; values at most MAX_ARG characters); only these are read, so no secret of the
    process leaves the host."""
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        key = k.decode("utf-8", "replace")
        if sep and key in names:
            out[key] = v.decode("utf-8", "replace")[:MAX_ARG]
    return out


def environ(pid, names):
    """{name: value} of the variables `names` in /proc/PID/environ (the environment the process
    started with: parse_environ); {} when it cannot be read."""
    return parse_environ(read("/proc/%d/environ" % pid, "rb") or b"", names)


def proc_table(host_view):
    """{pid: (argv, ppid)} for processes in this mount namespace, and those in others that
    `host_view(pid)` reads as the host's (system services); [pid] of the servers (tops of their
    trees there: a server whose parent is a server is its worker) in other mount namespaces."""
    own_mnt = os.readlink("/proc/self/ns/mnt") if os.path.exists("/proc/self/ns/mnt") else None
    table, others, parents = {}, [], {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        argv = cmdline(int(d))
        stat = read("/proc/%s/stat" % d)
        if not argv or not stat:
            continue
        try:
            mnt = os.readlink("/proc/%s/ns/mnt" % d)
        except OSError:
            mnt = own_mnt
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if own_mnt is not None and mnt != own_mnt and not host_view(int(d)):
            if server_kind(argv) and is_python(int(d)):
                others.append(int(d))
                parents[int(d)] = ppid
            continue
        table[int(d)] = (argv, ppid)
    return table, sorted(p for p in others if parents[p] not in parents)


def interpreter(pid, argv):
    """The python path a process runs: argv[0] when it names the same file as /proc/PID/exe
    (absolute, relative to the process's cwd, or looked up on its own PATH), which keeps a
    venv's `bin/python` rather than the base interpreter it links to; else /proc/PID/exe.
    None when /proc/PID/exe cannot be read."""
    try:
        exe = os.readlink("/proc/%d/exe" % pid)
    except OSError:
        return None
    real = os.path.realpath(exe)
    first = argv[0] if argv else ""
    cwd = _cwd(pid) or "/"
    if "/" in first:
        names = [os.path.normpath(os.path.join(cwd, first))]
    else:
        path = environ(pid, {"PATH"}).get("PATH", "")
        names = [os.path.join(os.path.join(cwd, d) if d else cwd, first) for d in path.split(":")] if first else []
    for name in names:
        if os.path.isfile(name) and os.path.realpath(name) == real:
            return name
    return exe


def parse_cgroup(text):
    """The systemd service of /proc/PID/cgroup text: the `NAME.service` its cgroup path ends in
    under /system.slice (the unified hierarchy's `0::` line, else name=systemd's; cgroups(7),
    systemd.special(7)), or None."""
    lines = text.splitlines()
    for line in [ln for ln in lines if ln.startswith("0::")] + [ln for ln in lines if ":name=systemd:" in ln]:
        parts = line.split(":", 2)[2].split("/")
        if len(parts) > 2 and parts[1] == "system.slice" and parts[-1].endswith(".service"):
            return parts[-1][:MAX_ARG]
    return None


def service_unit(pid):
    """The systemd service process `pid` runs in (parse_cgroup of its /proc/PID/cgroup), or None.
    A label for reports: what the process is trusted with is containers.classify's."""
    return parse_cgroup(read("/proc/%d/cgroup" % pid) or "")


def _cwd(pid):
    try:
        return os.readlink("/proc/%d/cwd" % pid)
    except OSError:
        return None


def import_path(pid, argv):
    """The entries a process's `sys.path` started with before site-packages, as Python set them
    (python(1): `-m` and `-c` put the working directory first, a script its own directory;
    `-I`, `-P` or PYTHONSAFEPATH put nothing; PYTHONPATH follows unless -I or -E). Paths are
    absolute, relative ones taken against /proc/PID/cwd."""
    flags, kind, target, _ = python_program(argv)
    env = environ(pid, {"PYTHONPATH", "PYTHONSAFEPATH"})
    cwd = _cwd(pid) or "/"
    entries = []
    if "I" not in flags and "P" not in flags and not ("E" not in flags and env.get("PYTHONSAFEPATH")):
        if kind in ("m", "c", "-"):
            entries.append(cwd)
        elif kind == "script" and target:
            entries.append(os.path.dirname(os.path.realpath(os.path.join(cwd, target))))
    if "I" not in flags and "E" not in flags:
        entries += [os.path.join(cwd, p) for p in env.get("PYTHONPATH", "").split(":") if p]
    return entries


def _listening_ports(pids):
    """{pid: sorted TCP ports it listens on itself}, each socket looked up in the process's own
    network namespace (listeners.held)."""
    return {pid: sorted({port for _, _, port, _ in held}) for pid, held in listeners.held(pids).items()}


def server_fields(argv, env, unit):
    """What a server's own argv, environment and service say of it: {argv (redacted), kind
    (server_kind), port, host, model_path (redacted), unit, pd (its PD part: pd.role), the layout (topology.KEYS:
    topology.read), cuda_visible_devices (None: unset), gpu_ids (topology.gpu_ids)}. `env`:
    {CUDA_VISIBLE_DEVICES: value} when set (parse_environ); `unit`: parse_cgroup's. Flags per
    sglang/srt/server_args.py (--port default 30000, --host, --model-path)."""
    port = topology.option(argv, "--port")
    layout = topology.read(argv)
    _, kind, target, args = python_program(argv)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    return {"argv": redact.argv(argv), "kind": server_kind(argv),
            "port": int(port) if port and port.isdigit() else DEFAULT_PORT,
            "host": redact.text(topology.option(argv, "--host") or "127.0.0.1"),
            "model_path": redact.text(topology.option(argv, "--model-path", "--model")), "unit": unit,
            "pd": pd.role(target if kind == "m" else None, args),
            **{k: layout[k] for k in topology.KEYS},
            "cuda_visible_devices": visible, "gpu_ids": topology.gpu_ids(layout, visible)}


def ancestors(pid, table):
    """The pids above `pid` in `table` (proc_table's), its parent first, up to (not counting)
    init or a pid outside the table."""
    seen, p = [], table[pid][1]
    while p in table and p not in seen and p > 1:
        seen.append(p)
        p = table[p][1]
    return seen


def unreadable_servers():
    """The processes whose argv is a server's (server_kind; /proc/PID/cmdline anyone may read) but
    whose /proc/PID/exe this login may not read: another user's process, whose exe, cwd, environ
    and fd need ptrace read access (proc(5), ptrace(2) "Ptrace access mode checking"), so
    find_servers cannot tell what it runs and leaves it out. One per process tree (a listed
    process's child is its worker). Returns [{pid, uid, user, port, kind, reason}] (reason:
    "not readable as LOGIN: safefs.BECOME_FIX"); [] for root, who reads them all."""
    if os.geteuid() == 0:
        return []
    found = {}
    for d in os.listdir("/proc"):
        argv = cmdline(int(d)) if d.isdigit() else None
        if not argv or not server_kind(argv):
            continue
        try:
            os.readlink("/proc/%s/exe" % d)
            continue
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM):
                continue
        stat = read("/proc/%s/stat" % d)
        found[int(d)] = (argv, int(stat.rsplit(")", 1)[1].split()[1]) if stat else 0)
    out = []
    for pid, (argv, ppid) in sorted(found.items()):
        if ppid in found:
            continue
        ids = runas.ids_of(pid)
        port = topology.option(argv, "--port")
        out.append({"pid": pid, "uid": ids[0] if ids else None, "user": safefs.login_name(ids[0]) if ids else None,
                    "port": int(port) if port and port.isdigit() else DEFAULT_PORT, "kind": server_kind(argv),
                    "reason": "not readable as %s: %s" % (safefs.login_name(os.geteuid()), safefs.BECOME_FIX)})
    return out


def find_servers(host_view=lambda pid: False):
    """Running SGLang servers in this mount namespace (and in the others that `host_view(pid)`
    reads as the host's: containers.host_view, system services), one per process tree.

    Returns ([{pid, argv, kind, port, host, uid (its effective uid: runas.ids_of; None when it
    exited meanwhile), ppid, model_path, tp_size, dp_size, pp_size,
    enable_dp_attention, nnodes, node_rank, dist_init_addr, base_gpu_id, gpu_id_step (the layout:
    topology.read), python, cwd, import_path, unit (service_unit), cuda_visible_devices (None:
    unset), gpu_ids (topology.gpu_ids: the devices its schedulers run on, as the host names them),
    workers: [{pid, ports}], processes}], [pid] of the
    servers in other mount namespaces: containers, see containers.py). `python`: see interpreter();
    `import_path`: see import_path(); `processes`: the server's `sglang::` titled descendants;
    `workers`: a router's Python children that listen on TCP ports (its DP workers; not its
    multiprocessing resource tracker), and servers started below this one, with their ports.
    The fields from the server's own argv, environment and cgroup are server_fields'.
    Secrets in argv, model_path and host (--api-key, tokens, headers, URL passwords, signed-URL
    parameters) are redacted here, before they leave the host (redact.py)."""
    table, others = proc_table(host_view)
    cands = {pid for pid, (argv, _) in table.items() if server_kind(argv) and is_python(pid)}
    tops = {pid for pid in cands if not any(a in cands for a in ancestors(pid, table))}
    below = {}
    for pid in table:
        top = next((a for a in reversed(ancestors(pid, table)) if a in tops), None)
        if top is not None:
            below.setdefault(top, []).append(pid)
    servers = []
    for pid in sorted(tops):
        argv = table[pid][0]
        own = server_fields(argv, environ(pid, {"CUDA_VISIBLE_DEVICES"}), service_unit(pid))
        kids = sorted(below.get(pid, []))
        children = [p for p in kids if own["kind"] == "router" and table[p][1] == pid and is_python(p)]
        ports = _listening_ports(set(children) | (set(kids) & cands))
        workers = [p for p in kids if p in cands or (p in children and ports[p])]
        head = {k: own.pop(k) for k in ("argv", "kind", "port", "host", "model_path")}
        ids = runas.ids_of(pid)
        servers.append({
            "pid": pid, **head, "uid": ids[0] if ids else None, "ppid": table[pid][1],
            "python": interpreter(pid, argv), "cwd": _cwd(pid), "import_path": import_path(pid, argv), **own,
            "workers": [{"pid": p, "ports": ports[p]} for p in workers],
            "processes": sum(1 for p in kids if table[p][0][:1] and table[p][0][0].startswith("sglang::")),
        })
    pd_peers(servers, listeners.local_addresses())
    return servers, others


def pd_peers(servers, local=()):
    """Name each PD server's peers on this host, in place: a PD router's pd gets "workers"
    [{pid, port, role}] (the servers here its --prefill / --decode URLs name: pd.routed, on
    loopback, a wildcard or an address in `local`), a worker's pd "routers" [{pid, port}] (the
    routers here that send to it)."""
    for s in servers:
        if s.get("pd") and s["pd"]["role"] != "router":
            s["pd"]["routers"] = []
    for r in servers:
        if not r.get("pd") or r["pd"]["role"] != "router":
            continue
        ports = pd.routed(r["pd"], local)
        r["pd"]["workers"] = []
        for s in servers:
            if s.get("pd") and s["pd"]["role"] != "router" and s["port"] in ports:
                r["pd"]["workers"].append({"pid": s["pid"], "port": s["port"], "role": s["pd"]["role"]})
                s["pd"]["routers"].append({"pid": r["pid"], "port": r["port"]})
