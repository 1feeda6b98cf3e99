"""Allocator replay probe (stdlib only, Python 3.8+): is defrag needed here? The install's own KV
allocator classes, driven on the CPU through a seeded continuous-batching trace, once with
need_sort=False and once with True, and how fragmented that leaves each prefill allocation.

The probe (main) runs under any interpreter: it finds the release's allocator classes by reading
its sources with `ast` (find_classes: `TokenToKVPoolAllocator` and `PagedTokenToKVPoolAllocator`
in sglang/srt/mem_cache/allocator.py, the allocator/ package of later releases, or memory_pool.py
and paged_allocator.py of older ones), refuses files another user could have written (they
would run as the probing user: trust's rule), sizes the pool (the server's own
max_total_num_tokens from its /server_info, asked through the target rule, when no pool is
given), makes the trace (make_trace) and runs the replay in a child: the install's interpreter,
started with its site module (its torch is the install's) as an unprivileged uid (runas: the
install's server's, else its owner, else nobody; never root), as `python -I -c WRAPPER` with this
probe's own bundle (action "replay"), in its own session at nice 10, under RLIMIT_AS and
RLIMIT_CPU, killed with its whole group at a deadline. No server is touched by the
replay: it runs the allocator classes alone, on "cpu".

The child (replaychild.py: replay) loads the release's files from the text the probe read, stubs
every other `sglang.*` module and `triton`, and drives each class through the trace (make_trace:
seeded prompt and output lengths, aborts); the figure is the contiguous runs in each prefill
allocation (1: one contiguous range). A file that needs more than the replay gives it is
reported with its file and line, never a crash.
"""

import ast
import glob
import json
import os
import random
import resource
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request

from .. import runas
from ..facts import targets
from . import replaychild

TOKEN, PAGED = "TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator"
# the allocator package of releases that split it (0.5.23: base.py, token.py, paged.py): its
# modules are loaded from the release's files; every other sglang module is a stub
ALLOCATOR_PACKAGE = "sglang.srt.mem_cache.allocator"
# where the classes live, relative to the package directory (sglang/), in the order looked at
CANDIDATES = ("srt/mem_cache/allocator/*.py", "srt/mem_cache/allocator.py", "srt/mem_cache/memory_pool.py",
              "srt/mem_cache/paged_allocator.py")
MAX_SOURCE = 4 << 20  # bytes of one source file read at most
DEADLINE_S = 300.0  # the replay's default wall-clock deadline (seconds)
MEMORY_BYTES = 4 << 30  # the replay's default address-space limit (bytes): torch maps ~0.7 GiB
DEFAULTS = {"pool": 65536, "concurrency": 16, "input": [64, 2048], "output": [16, 1024], "aborts": 0.1,
            "seed": 0, "requests": 800, "page_size": 16}
ABORT_AFTER = (1, 8)  # an aborted request stops after this many output tokens (uniform)
SERVER_INFO_TIMEOUT_S = 10.0
MAX_BODY = 16 << 20
# the servers are on this host: never through the environment's proxies (review L9)
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def main(params):
    """params: {"action": "replay" (the child: see replaychild.replay) or absent, "package_dir": the
    install's sglang/ directory, "location": its parent, "trace": {pool (None: the server's or
    DEFAULTS'), concurrency, input [lo, hi], output [lo, hi], aborts (a share), seed, requests,
    page_size} (DEFAULTS fill what is missing), "servers": the install's servers as targets.live
    selectors ([{pid, python, port, host}]), "port", "host", "api_key" (for /server_info, never
    returned), "deadline_s", "memory_bytes", "unprivileged_user" (the inventory's; runas.account)}.
    Returns {"status": "replayed" | "no_need_sort" | "failed", "reason": why not replayed (None when
    replayed), "classes": find_classes' answer, "trace": the parameters used with "pool_source"
    (None for a release without need_sort), "runs": [run, ...] (replaychild.drive's: token then
    paged, need_sort False then True), "stubbed": the stub modules the files imported, "torch": its
    version, "elapsed_s": seconds, "ran_as": {uid, why}: the account the replay ran as (runas.account),
    None when it was not started}. Never raises for the release's code: what went wrong is the
    reason."""
    if params.get("action") == "replay":
        return replaychild.replay(params)
    t0 = time.monotonic()
    out = {"status": "failed", "reason": None, "classes": [], "trace": None, "runs": [], "stubbed": [],
           "torch": None, "elapsed_s": None, "ran_as": None}
    try:
        _prepare(params, out)
    finally:
        out["elapsed_s"] = round(time.monotonic() - t0, 3)
    return out


def _prepare(params, out):
    """main's work on `out`, in order: the classes, the trace, the files' and the interpreter's
    check, the child."""
    package_dir, location = params["package_dir"], params["location"]
    classes = find_classes(package_dir, location)
    out["classes"] = classes
    if not classes:
        out["reason"] = "no %s or %s found under %s (looked in %s)" % (TOKEN, PAGED, package_dir, ", ".join(CANDIDATES))
        return
    classes = [c for c in classes if c["need_sort"] is not False]
    if not classes:
        out["status"] = "no_need_sort"
        out["reason"] = "no need_sort: " + "; ".join("%s (%s:%d) takes no need_sort" % (c["class"], c["file"], c["line"])
                                                     for c in out["classes"])
        return
    trace = dict(DEFAULTS, **{k: v for k, v in (params.get("trace") or {}).items() if v is not None})
    trace["pool_source"] = "--pool"
    if (params.get("trace") or {}).get("pool") is None:
        trace["pool"], trace["pool_source"] = server_pool(params.get("servers") or [], params.get("port"), params.get("host"),
                                                          params.get("api_key"), params.get("server_user"))
    out["trace"] = trace
    bad = check_trace(trace)
    if bad:
        out["reason"] = bad
        return
    sources = {}
    for c in classes:
        for name, path in c["modules"]:
            if name not in sources:
                text, why = read_trusted(os.path.join(location, path))
                if why:
                    out["reason"] = "%s: the replay would run it as this user (trust's rule)" % why
                    return
                sources[name] = [path, text]
    python = sys.executable
    try:
        acct = runas.account([s["pid"] for s in params.get("servers") or [] if s.get("pid")], package_dir,
                             params.get("unprivileged_user"))
    except runas.NoAccount as e:
        out["reason"] = "the replay imports the install's code, never as root: %s" % e
        return
    out["ran_as"] = {"uid": acct.uid, "why": acct.why}
    child = {"action": "replay", "sources": sources, "trace": make_trace(trace), "pool": trace["pool"],
             "concurrency": trace["concurrency"], "page_size": trace["page_size"],
             "classes": [{k: c[k] for k in ("kind", "class", "module")} for c in classes]}
    deadline = float(params.get("deadline_s") or DEADLINE_S)
    got, why = run_child(python, child, deadline, int(params.get("memory_bytes") or MEMORY_BYTES), acct)
    if why:
        out["reason"] = why
        return
    out.update({k: got.get(k) for k in ("runs", "stubbed", "torch")})
    if got.get("error"):
        out["reason"] = got["error"]
        return
    out["status"] = "replayed"


def find_classes(package_dir, location):
    """The allocator classes of the install whose sglang/ is `package_dir` (its parent
    `location`), read with `ast` (nothing imported): [{"kind": "token" | "paged", "class",
    "file": relative to location, "line", "module": its module name, "need_sort": whether it takes need_sort
    (_takes_need_sort: None when that is not known from its file),
    "modules": [[module name, file]] the replay loads from source: its file and, in the
    allocator package, the package's modules it imports, transitively}]. Token first; a kind
    the release lacks is left out. A file that cannot be read or parsed is passed over."""
    found = {}
    for pattern in CANDIDATES:
        for path in _glob(package_dir, pattern):
            text = _read(path)
            if text is None or not any(("class %s" % n) in text for n in (TOKEN, PAGED)):
                continue
            try:
                tree = ast.parse(text)
            except (SyntaxError, ValueError):
                continue
            defs = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
            rel = os.path.relpath(path, location)
            for kind, name in (("token", TOKEN), ("paged", PAGED)):
                if name in defs and kind not in found:
                    module = module_name(rel)
                    found[kind] = {"kind": kind, "class": name, "file": rel, "line": defs[name].lineno,
                                   "module": module, "need_sort": _takes_need_sort(defs[name], defs),
                                   "modules": _local_modules(module, rel, tree, location)}
    return [found[k] for k in ("token", "paged") if k in found]


def _glob(package_dir, pattern):
    return sorted(p for p in glob.glob(os.path.join(glob.escape(package_dir), pattern))
                  if not os.path.islink(p) and os.path.isfile(p))


def _read(path):
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SOURCE + 1)
    except OSError:
        return None
    return data.decode("utf-8", "replace") if len(data) <= MAX_SOURCE else None


def module_name(rel):
    """The module name of file `rel` (relative to the sys.path entry): sglang/a/b.py -> sglang.a.b."""
    parts = rel[:-3].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _takes_need_sort(cls, defs, seen=()):
    """Whether class `cls` (of a file whose classes are `defs`) takes need_sort: its own __init__'s
    parameters, else its first base class of the same file with one; None when its __init__ comes
    from another file (not known without importing it: the replay then tries, see drive)."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            a = node.args
            return any(x.arg == "need_sort" for x in a.posonlyargs + a.args + a.kwonlyargs)
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in defs and base.id not in seen:
            return _takes_need_sort(defs[base.id], defs, seen + (cls.name,))
    return None if cls.bases else False


def _local_modules(module, rel, tree, location):
    """[[module, file]]: `module` (file `rel`) and the ALLOCATOR_PACKAGE modules it imports whose
    files exist under `location`, transitively (each file read with ast)."""
    out, todo = [], [(module, rel, tree)]
    while todo:
        name, path, t = todo.pop(0)
        if any(name == m for m, _ in out):
            continue
        out.append([name, path])
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for dep in _imported(t, package):
            if not dep.startswith(ALLOCATOR_PACKAGE + ".") or any(dep == m for m, _ in out):
                continue
            dep_rel = os.path.join(*dep.split(".")) + ".py"
            text = _read(os.path.join(location, dep_rel))
            if text is None:
                continue
            try:
                todo.append((dep, dep_rel, ast.parse(text)))
            except (SyntaxError, ValueError):
                continue
    return out


def _imported(tree, package):
    """Absolute names of the modules `tree` imports (from X import y: X and X.y), relative ones
    resolved against `package`."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names += [base] + ["%s.%s" % (base, a.name) for a in node.names]
    return names


def read_trusted(path):
    """(text, None) of source file `path`, or (None, why) when it must not be run: not a regular
    file, a symlink, over MAX_SOURCE, or one another user could have written (its owner is not
    root or this user, or group/others may write it: trust's rule), judged on the open file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        return None, "cannot open %s: %s" % (path, e.strerror)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "%s is not a regular file" % path
        if st.st_uid not in (0, os.geteuid()):
            return None, "%s belongs to uid %d" % (path, st.st_uid)
        if st.st_mode & 0o022:
            return None, "%s is writable by group or others" % path
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_SOURCE + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_SOURCE:
        return None, "%s is over %d MiB" % (path, MAX_SOURCE >> 20)
    return data.decode("utf-8", "replace"), None


def check_trace(trace, pool_known=True):
    """Why trace parameters `trace` (DEFAULTS' keys, + "pool_source") cannot be replayed, naming the
    flag, or None. `pool_known`: False leaves the pool out (the server's is not known yet)."""
    lo_in, hi_in = trace["input"]
    lo_out, hi_out = trace["output"]
    checks = ((pool_known and trace["pool"] < 1, "--pool must be at least 1, not %s" % trace["pool"]),
              (trace["concurrency"] < 1, "--concurrency must be at least 1, not %s" % trace["concurrency"]),
              (trace["requests"] < 1, "--requests must be at least 1, not %s" % trace["requests"]),
              (not 1 <= lo_in <= hi_in, "--input %s:%s: want 1 <= A <= B" % (lo_in, hi_in)),
              (not 1 <= lo_out <= hi_out, "--output %s:%s: want 1 <= A <= B" % (lo_out, hi_out)),
              (not 0 <= trace["aborts"] <= 1, "--aborts %s: want a share from 0 to 1" % trace["aborts"]),
              (trace["page_size"] < 1, "page size %s: want at least 1" % trace["page_size"]))
    for bad, why in checks:
        if bad:
            return why
    if not pool_known:
        return None
    longest = replaychild.pages(hi_in + hi_out, trace["page_size"]) * trace["page_size"]
    usable = trace["pool"] // trace["page_size"] * trace["page_size"]
    if longest > usable:
        return ("the longest request (--input %d + --output %d, %d tokens in pages of %d) does not fit the pool of %d "
                "(%s): give a larger --pool or shorter lengths" % (hi_in, hi_out, longest, trace["page_size"],
                                                                   trace["pool"], trace.get("pool_source", "--pool")))
    return None


def make_trace(trace):
    """The requests of trace parameters `trace` ({requests, input [lo, hi], output [lo, hi],
    aborts, seed}): [[prompt tokens, output tokens], ...] in arrival order, drawn by
    random.Random(seed): prompt and output lengths uniform in their ranges; each request aborts
    with probability `aborts` and then stops after ABORT_AFTER output tokens (never more than
    its drawn length)."""
    rng = random.Random(trace["seed"])
    out = []
    for _ in range(int(trace["requests"])):
        prompt = rng.randint(*trace["input"])
        output = rng.randint(*trace["output"])
        if rng.random() < trace["aborts"]:
            output = min(output, rng.randint(*ABORT_AFTER))
        out.append([prompt, output])
    return out


def server_pool(selectors, port, host, api_key, server_user=None):
    """(pool, source) for a replay given no pool: the first of the install's servers that states
    max_total_num_tokens in its /server_info (or /get_server_info before 0.5), asked through the
    target rule (targets.pick: only a server's own socket on this host, of an owner it accepts
    (`server_user`); the API key as a bearer token), source "max_total_num_tokens of server pid P at H:P"; else DEFAULTS' pool, source
    "default; " and why."""
    why = "no server runs from this install"
    if selectors:
        picked = targets.pick(selectors, port, host, server_user)
        why = "; ".join("pid %s: %s" % (r["pid"], r["reason"]) for r in picked["refused"] + picked["pending"]) or why
        for t in picked["targets"]:
            label = "server pid %s at %s:%d" % (t["pid"], t["host"], t["port"])
            value, err = _max_total_num_tokens(t["host"], t["port"], api_key)
            if value:
                return value, "max_total_num_tokens of %s" % label
            why = "%s: %s" % (label, err)
    return DEFAULTS["pool"], "default; %s" % why


def _max_total_num_tokens(host, port, api_key):
    """(max_total_num_tokens, None) from the server's /server_info, or (None, why)."""
    base = "http://%s:%d" % (host if ":" not in host else "[%s]" % host, int(port))
    why = "no answer"
    for path in ("/server_info", "/get_server_info"):
        req = urllib.request.Request(base + path, headers={"Authorization": "Bearer " + api_key} if api_key else {})
        try:
            with _OPENER.open(req, timeout=SERVER_INFO_TIMEOUT_S) as r:
                body = json.loads(r.read(MAX_BODY))
        except urllib.error.HTTPError as e:
            why = "%s answered HTTP %d" % (path, e.code)
            continue
        except (OSError, ValueError) as e:
            why = "%s: %s" % (path, getattr(e, "reason", None) or e)
            continue
        body = body if isinstance(body, dict) else {}
        value = body.get("max_total_num_tokens")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, None
        return None, "%s states no max_total_num_tokens%s" % (path, " (a stand-in)" if body.get("stand_in") else "")
    return None, why


def run_child(python, child, deadline_s, memory_bytes, acct):
    """This probe's bundle re-run under `python -I` (with its site: the install's torch) with
    params `child` as runas.Account `acct` (runas.rerun: its own session, an environment from
    nothing), nice 10, RLIMIT_AS `memory_bytes` and RLIMIT_CPU the deadline, killed with its
    group after `deadline_s` seconds. Returns (its result, None) or (None, why)."""
    cpu = int(deadline_s) + 1
    who = "uid %d (%s)" % (acct.uid, acct.why)
    try:
        got, why, ran = runas.rerun(python, dict(child, deadline_s=deadline_s), acct, deadline_s + 5,
                                    {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, nice=10,
                                    rlimits={resource.RLIMIT_AS: memory_bytes, resource.RLIMIT_CPU: cpu})
    except (OSError, subprocess.SubprocessError, runas.NoAccount) as e:
        return None, "the replay could not start as %s: %s" % (who, e)
    if ran.timed_out:
        return None, "the replay passed its deadline of %.0f s and was killed: give fewer --requests or a smaller --pool" \
            % deadline_s
    if ran.returncode < 0:
        return None, "the replay was killed by signal %d (its limits: %d s of CPU, %d MiB of memory): %s" % (
            -ran.returncode, cpu, memory_bytes >> 20, ran.stderr.decode("utf-8", "replace").strip()[-1500:] or "no output")
    if why:
        return None, "the replay %s" % why
    return got, None
