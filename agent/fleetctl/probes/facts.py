"""Inspect probe: facts about one host, its SGLang installs and their allocator call sites.

Runs on the host, stdlib only (Python 3.8+), sent by fleetctl over SSH stdin with its helpers
(procs: servers; locate: where `import sglang` resolves; gpus: nvidia-smi; callsites: the scan;
torchver: torch's version).
Data flows one way: servers (procs.find_servers) -> interpreters to ask -> installs (each asked of
its own interpreter with locate.locate, the bundle re-run as `python -I`) -> a scan per install
(callsites.scan) -> the primary install, whose facts stay at the top level.

Interpreters asked: each running server's own (with its working directory and PYTHONPATH); the
inventory's ansible_python_interpreter / fleetctl_python (params["python"]); python3 on PATH and
common venv locations whose site directories hold an sglang distribution. An interpreter is run
only after trust.untrusted() clears it (its `.pth` files run at start), by this probe, just
before it starts it.
"""

import glob
import json
import os
import subprocess
import sys
import time

from . import callsites, containers, gpus, locate, procs, result, scancache, torchver, trust

COMMON_PYTHONS = [
    "/opt/*/venv/bin/python", "/opt/*/.venv/bin/python", "/opt/venv/bin/python",
    "/opt/conda/bin/python", "/opt/conda/envs/*/bin/python", "/root/.venv/bin/python",
    "/root/venv/bin/python", "/home/*/.venv/bin/python", "/home/*/venv/bin/python",
    "/workspace/*/.venv/bin/python", "/usr/local/bin/python3", "/usr/bin/python3",
]
LOCATE_TIMEOUT_S = 60  # one interpreter's start + find_spec (site runs every .pth file)
SEVERAL = "several installs, no server: see installs"
NONE_FOUND = "no interpreter with an sglang distribution found"


_DIST_MARKS = ("sglang-*.dist-info", "sglang-*.egg-info", "sglang.egg-link", "__editable__.sglang-*")


MAX_PTH_BYTES = 1 << 20  # a .pth file read for its path lines (site.py's own have a few lines)


def _pth_paths(site_dir):
    """The directories the `.pth` files in `site_dir` add to sys.path (site.py: each line that
    is not blank, a comment or an `import` line, relative to the site directory). A `.pth` is
    read only when it is a regular file (never a FIFO, never through a symlink), up to
    MAX_PTH_BYTES."""
    out = []
    for pth in sorted(glob.glob(os.path.join(glob.escape(site_dir), "*.pth"))):
        try:
            data = callsites.read_source(pth)[0][:MAX_PTH_BYTES]
        except OSError:
            continue
        for line in data.decode("utf-8", "replace").splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "import ", "import\t")):
                out.append(os.path.join(site_dir, line))
    return out


def may_have_sglang(python):
    """Whether an idle interpreter (no server runs it) is worth asking: one of its site
    directories holds an sglang distribution (dist-info, egg-info, egg-link or PEP 660 editable
    hook), or a `.pth` file there puts a directory holding `sglang/__init__.py` on sys.path (a
    checkout added by hand or by `conda develop`, with no distribution). Without one, its
    `import sglang` could only come from a working directory or PYTHONPATH, which an idle
    interpreter has not got."""
    dirs = trust.site_dirs(python)
    return (any(glob.glob(os.path.join(glob.escape(d), m)) for d in dirs for m in _DIST_MARKS)
            or any(os.path.isfile(os.path.join(p, "sglang", "__init__.py")) for d in dirs for p in _pth_paths(d)))


def candidates(params, servers):
    """Interpreters to ask, in order: [(python, sys.path entries put first, reason, server pid
    or None)]: each server's, the inventory's, then python3 on PATH and common venv locations
    that may_have_sglang (so that installs no server runs from are listed too)."""
    out = [(s["python"], s["import_path"], "running server pid %d" % s["pid"], s["pid"])
           for s in servers if s["python"]]
    if params.get("python"):
        out.append((params["python"], [], "inventory", None))
    idle = []
    for d in os.environ.get("PATH", "/usr/bin").split(os.pathsep):
        p = os.path.join(d, "python3")
        if os.path.exists(p):
            idle.append((p, [], "python3 on PATH", None))
            break
    idle += [(p, [], "common location", None) for pat in COMMON_PYTHONS for p in sorted(glob.glob(pat))]
    return out + [c for c in idle if may_have_sglang(c[0])]


def ask(python, first, timeout=LOCATE_TIMEOUT_S):
    """Run this probe bundle as `python -I` in / to locate sglang there (see locate.locate):
    {python, sglang, error, torch}. Raises RuntimeError when it prints no result."""
    doc = json.loads(FLEETCTL_BUNDLE)  # noqa: F821 (set by the probe wrapper)
    doc["params"] = {"locate": first}
    try:
        r = subprocess.run([python, "-I", "-c", FLEETCTL_WRAPPER], input=json.dumps(doc).encode(),  # noqa: F821
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/", timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError("did not answer within %d s" % timeout)
    found = result.after_marker(r.stdout.decode("utf-8", "replace"))
    if found is None:
        raise RuntimeError("printed no result (exit %d): %s"
                           % (r.returncode, r.stderr.decode("utf-8", "replace")[-1500:]))
    res = json.loads(found)
    if "__probe_error__" in res:
        raise RuntimeError(res["__probe_error__"][-1500:])
    return res


def _stamp(python, first, package_dir):
    """Identities ([path, size, mtime_ns, ctime_ns, inode] or [path]) of what decides where
    `import sglang` resolves for `python` with `first` put first, and what it answers: the real
    interpreter, its site directories and their .pth files, the `first` entries, and the package
    directory with its __init__.py and version.py (a pip install or removal changes a site
    directory; a checkout's version lives in version.py)."""
    paths = [os.path.realpath(python)] + list(first)
    for d in trust.site_dirs(python):
        paths += [d] + sorted(glob.glob(os.path.join(glob.escape(d), "*.pth")))
    if package_dir:
        paths += [package_dir, os.path.dirname(package_dir)]
        paths += [os.path.join(package_dir, n) for n in ("__init__.py", "version.py")]
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append([p, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
        except OSError:
            out.append([p])
    return out


def located(python, first, store):
    """ask(python, first), or its answer kept in `store` (a scancache.Store, or None) while the
    _stamp it was given under still holds: a warm run starts no second interpreter. An answer
    whose sglang has no package directory is never kept. Raises what ask raises."""
    ident = json.dumps([python, list(first)])
    if store is not None:
        kept, _ = store.load(ident, "locate")
        res = kept.get("answer")
        if res and kept.get("stamp") == _stamp(python, first, (res.get("sglang") or {}).get("package_dir")):
            return res
    res = ask(python, first)
    found = res.get("sglang") or {}
    if store is not None and (not found or found.get("package_dir")):
        # an sglang without its package directory (a moved checkout) is asked again each run: what
        # brings the directory back (a rename) changes nothing the stamp covers
        try:
            store.save(ident, os.path.dirname(python), {
                "answer": res, "stamp": _stamp(python, first, (res.get("sglang") or {}).get("package_dir"))}, "locate")
        except OSError:
            pass  # the cache is an optimisation: the answer stands
    return res


def discover(params, servers, store=None):
    """The installs on this host: ([{id, python, sglang, torch, servers: [pid], error}],
    [{python, reason, sglang (version or None), skipped | error}] interpreters considered).
    Sets each server's `install` (its install id, None when its interpreter has no sglang).
    `store`: a scancache.Store keeping interpreters' answers (see located), or None.
    An install's id is "host:<package_dir>" (or "host:<location>" when the package directory
    was not found)."""
    installs, considered, asked = {}, [], {}
    for s in servers:
        s["install"] = None
    for python, first, why, pid in candidates(params, servers):
        key = (python, tuple(first))
        if key not in asked:
            entry = {"python": python, "reason": why, "sglang": None}
            considered.append(entry)
            asked[key] = None
            if not os.access(python, os.X_OK):
                entry["skipped"] = "not executable"
                continue
            why_not = trust.untrusted(python)
            if why_not:
                entry["skipped"] = why_not
                continue
            try:
                asked[key] = located(python, first, store)
            except (RuntimeError, OSError) as e:
                entry["error"] = str(e)
                continue
            entry["sglang"] = (asked[key]["sglang"] or {}).get("version")
        res = asked[key]
        if not res or not res["sglang"]:
            continue
        sg = res["sglang"]
        iid = "host:" + (sg["package_dir"] or sg["location"])
        inst = installs.setdefault(iid, {"id": iid, "python": dict(res["python"], path=python), "sglang": sg,
                                         "torch": res["torch"], "servers": [], "error": res["error"]})
        if pid is not None:
            inst["servers"].append(pid)
            next(s for s in servers if s["pid"] == pid)["install"] = iid
    return list(installs.values()), considered


def scan_install(inst, with_sources, store=None):
    """Add allocator_call_sites, need_sort_origins and scan ({files, stats, parse_errors,
    phases_s, cache: {hits, misses, path, error}, elapsed_s, error}) to install `inst` (+ sources:
    {file relative to location: exact text, None when not UTF-8} of files with need_sort origins,
    when `with_sources`), reading and refreshing its scan cache in `store` (a scancache.Store;
    None: no cache). A package directory that was not found is scan.error, never an empty scan."""
    inst.update(allocator_call_sites=[], need_sort_origins=[])
    error = inst.pop("error")
    if error:
        inst["scan"] = {"error": error}
        return
    location = inst["sglang"]["location"]
    t0 = time.time()
    cached, why = store.load(inst["id"]) if store else (None, None)
    found = callsites.scan(location, cache=cached)
    found["cache"].update(path=store.file_path(inst["id"]) if store and store.fd is not None else None,
                          error=(store.error or why) if store else None)
    if store and found["cache"].pop("changed"):  # an unchanged cache is not written again
        try:
            store.save(inst["id"], inst["sglang"]["package_dir"], cached)
        except OSError as e:
            found["cache"]["error"] = "not written: %s" % e
    inst["allocator_call_sites"] = found.pop("allocator_call_sites")
    inst["need_sort_origins"] = found.pop("need_sort_origins")
    found.update(elapsed_s=round(time.time() - t0, 3), error=None)
    inst["scan"] = found
    if with_sources:
        inst["sources"] = {}
        for f in sorted({o["file"] for o in inst["need_sort_origins"]}):
            raw = procs.read(os.path.join(location, f), "rb")  # exact bytes: the sha256 must match
            try:
                inst["sources"][f] = raw.decode("utf-8") if raw is not None else None
            except UnicodeDecodeError:
                inst["sources"][f] = None  # not UTF-8: planning refuses this file, inspect goes on


def primary(installs, servers):
    """(the primary install or None, reason when None): the install of the server with the
    lowest pid; with no server, the only install; otherwise none."""
    by_id = dict((i["id"], i) for i in installs)
    for s in sorted(servers, key=lambda s: s["pid"]):
        if s.get("install") in by_id:
            return by_id[s["install"]], None
    if len(installs) == 1:
        return installs[0], None
    return None, SEVERAL if installs else NONE_FOUND


def record_interpreter(store, params):
    """Record this probe's interpreter in `store` (scancache.Store.keep_interpreter) for the next
    probe's start, only when it was found by the PATH search (no params["python"]): the record
    stands in for that search (probes._FINDER), which a host naming its interpreter never makes.
    Each start checks the record again (trust.GUARD)."""
    if params.get("python"):
        return
    try:
        store.keep_interpreter(sys.executable, trust.untrusted)
    except OSError:
        pass  # the record is an optimisation: the next run finds python3 on PATH again


def main(params):
    """params: python (str|None, inventory interpreter), scan (bool), with_sources (bool),
    cache_key (sha256 of the bundled probe sources; None: no scan cache, see scancache), inside
    (bool: run in a container; {"refused": why} when this interpreter fails trust.untrusted
    there, site files aside: the probe runs with -S); or
    locate ([sys.path entries]) when re-run inside an install's interpreter (see ask()).
    Returns {"facts", "installs", "allocator_call_sites", "need_sort_origins", "scan",
    ["sources"]}, the last four (and facts.sglang/python/torch) of the primary install."""
    if "locate" in params:
        res = locate.locate(params["locate"])
        res["torch"] = torchver.installed()
        return res
    if params.get("inside"):
        why = trust.untrusted(sys.executable, site=False)
        if why:  # checked inside, as the container's user: its own files, planted by nobody else
            return {"refused": "interpreter %s in the container refused: %s" % (sys.executable, why)}
    servers, others = procs.find_servers(containers.host_view)
    found = containers.containers(others) if params.get("containers", True) else []
    store = scancache.Store(params["cache_key"]) if params.get("cache_key") else None
    try:
        installs, considered = discover(params, servers, store)
        for inst in installs:
            if params.get("scan", True):
                scan_install(inst, params.get("with_sources"), store)
            else:
                inst["scan"] = {"error": inst.pop("error")} if inst.get("error") else None
                inst.pop("error", None)
        if store:
            store.prune([i["id"] for i in installs])
            record_interpreter(store, params)
    finally:
        if store:
            store.close()
    main_inst, reason = primary(installs, servers)
    gpu_rows, gpu_errors, gpus_reason = gpus.gpu_facts()
    facts = {
        "hostname": os.uname().nodename,  # what gethostname(2) answers on Linux, without importing socket
        "python": main_inst["python"] if main_inst else
        {"path": sys.executable, "version": "%d.%d.%d" % sys.version_info[:3]},
        "sglang": main_inst["sglang"] if main_inst else None,
        "sglang_reason": reason,
        "torch": main_inst["torch"] if main_inst else None,
        "gpus": gpu_rows, "gpu_errors": gpu_errors, "gpus_reason": gpus_reason,
        "servers": servers,
        "servers_in_other_namespaces": len(others),
        "containers": found, "runtime_clis": containers.clis(),
        "interpreter_discovery": {"python": main_inst["python"]["path"] if main_inst else None,
                                  "reason": reason or "install %s" % main_inst["id"], "considered": considered},
    }
    out = {"facts": facts, "installs": installs, "allocator_call_sites": [], "need_sort_origins": [],
           "scan": None}
    if params.get("records"):
        out["container_records"] = containers.records(params["records"])
    if main_inst:
        for k in ("allocator_call_sites", "need_sort_origins", "scan", "sources"):
            if k in main_inst:
                out[k] = main_inst[k]
    return out
