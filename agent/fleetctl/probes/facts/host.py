"""Inspect probe: facts about one host, its SGLang installs and their allocator call sites.

Runs on the host, stdlib only (Python 3.8+), sent by fleetctl over SSH stdin with its helpers
(procs: servers; units: systemd services; locate: where `import sglang` resolves; gpus:
nvidia-smi; callsites: the scan; torchver: torch's version).
Data flows one way: servers (procs.find_servers) -> interpreters to ask -> installs (each asked of
its own interpreter with locate.locate, the bundle re-run as `python -I`) -> a scan per install
(callsites.scan) -> the primary install, whose facts stay at the top level.

Interpreters asked: each running server's own (with its working directory and PYTHONPATH); the
inventory's ansible_python_interpreter / fleetctl_python (params["python"]); each systemd service
that runs SGLang (units.py), running or not; python3 on PATH, common venv locations, the venvs,
`uv tool` and pipx venvs under every home (homes: /home/*, /root, the passwd users' and the
running processes' users', a directory service's too), servers' project `.venv`s and the
interpreters of running Python processes that are no server (inuse.running), whose site
directories hold an sglang distribution. Each install says which processes use it without
being its server (inuse.mark: "in_use"), what a change refuses to go past unvalidated.
An interpreter is asked as an unprivileged uid (runas: the effective uid of a server running from it, else its tree's owner, else `nobody` or the
inventory's fleetctl_unprivileged_user: its site module runs its `.pth` lines, sitecustomize and
finders, which are the install's code, never root's); one that cannot be asked so (the account
cannot read it) or that does not answer is an install seen but not inspected ("not_inspected",
with the reason and the fix), never a host without SGLang.
"""

import glob
import json
import os
import subprocess
import sys
import time

from . import callsites, containers, gpus, inuse, locate, procs, scancache, torchver, units, verifyroute
from .. import bounded, runas, trust

COMMON_PYTHONS = [
    "/opt/*/venv/bin/python", "/opt/*/.venv/bin/python", "/opt/venv/bin/python",
    "/opt/conda/bin/python", "/opt/conda/envs/*/bin/python", "/root/.venv/bin/python",
    "/root/venv/bin/python", "/home/*/.venv/bin/python", "/home/*/venv/bin/python",
    "/workspace/*/.venv/bin/python", "/usr/local/bin/python3", "/usr/bin/python3",
]
# under each local user's home (facts.homes): (pattern, reason with the home)
HOME_PYTHONS = [
    (".venv/bin/python", "venv in %s"), ("venv/bin/python", "venv in %s"), ("*/.venv/bin/python", "project venv in %s"),
    (".local/share/uv/tools/*/bin/python", "uv tool of %s"), (".local/share/pipx/venvs/*/bin/python", "pipx venv of %s"),
    (".local/pipx/venvs/*/bin/python", "pipx venv of %s"),
]
LOCATE_TIMEOUT_S = 60  # one interpreter's start + find_spec (site runs every .pth file)
FIX = ("; give that account read access to the install, or name one that has it in the inventory's "
       "fleetctl_unprivileged_user (docs/security.md: what fleetctl needs on a host)")
SEVERAL = "several installs, no server: see installs"
NONE_FOUND = "no interpreter with an sglang distribution found"
NOT_INSPECTED = "not_inspected"  # vocab.InstallStatus.NOT_INSPECTED
MAX_USERS = 4096  # passwd entries whose homes are looked in (a directory service may list many more)


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


def homes(uids=()):
    """Home directories to look in for users' installs, each once (by its real path), those that
    exist: /root, every directory under /home (a user a directory service knows is listed by no
    file here, and a home may belong to root), the homes of the host's local users (/etc/passwd
    through pwd, its first MAX_USERS entries) and of the users `uids` (the running processes':
    pwd.getpwuid, which asks NSS: SSSD or LDAP answer for a user they do not enumerate). A
    passwd home is taken only when it belongs to its user (a system account's shared home, such
    as /usr/sbin or /, is no user's own); at most MAX_USERS homes."""
    entries = [("/root", None)] + [(h, None) for h in sorted(glob.glob("/home/*"))[:MAX_USERS]]
    try:
        import pwd
        entries += [(e.pw_dir, e.pw_uid) for e in pwd.getpwall()[:MAX_USERS]]
        for uid in sorted(set(uids))[:MAX_USERS]:
            try:
                entries.append((pwd.getpwuid(uid).pw_dir, uid))
            except (KeyError, OverflowError):
                continue  # a uid no user database knows: its home, if any, is under /home
    except ImportError:
        pass
    out, seen = [], set()
    for home, uid in entries:
        try:
            st = os.stat(home)
        except (OSError, ValueError):
            continue
        real = os.path.realpath(home)
        if (os.path.isabs(home) and os.path.isdir(home) and (uid is None or st.st_uid == uid)
                and real not in seen and real != "/"):
            seen.add(real)
            out.append(home)
    return out[:MAX_USERS]


def tool_pythons(uids=()):
    """Interpreters of the venvs SGLang's install docs and Python's tool installers make,
    [(python, reason)]: each home's (homes(uids)) project and plain venvs, `uv tool` tools
    (~/.local/share/uv/tools/NAME), pipx venvs (~/.local/share/pipx/venvs/NAME, older
    ~/.local/pipx/venvs/NAME), pipx's global venvs (/opt/pipx/venvs/NAME) and the directories
    this probe's own environment names ($PIPX_HOME, $PIPX_GLOBAL_HOME, $UV_TOOL_DIR)."""
    out = []
    for home in homes(uids):
        for pat, why in HOME_PYTHONS:
            out += [(p, why % home) for p in sorted(glob.glob(os.path.join(glob.escape(home), pat)))]
    named = [(os.environ.get("PIPX_HOME"), "venvs/*/bin/python", "$PIPX_HOME"),
             (os.environ.get("PIPX_GLOBAL_HOME") or "/opt/pipx", "venvs/*/bin/python", "pipx --global"),
             (os.environ.get("UV_TOOL_DIR"), "*/bin/python", "$UV_TOOL_DIR")]
    for top, pat, why in named:
        if top and os.path.isabs(top):
            out += [(p, why) for p in sorted(glob.glob(os.path.join(glob.escape(top), pat)))]
    return out


def _candidate(python, first, reason, pid=None, unit=None, idle=False):
    return {"python": python, "first": list(first), "reason": reason, "pid": pid, "unit": unit, "idle": idle}


def candidates(params, servers, services=(), running=((), ())):
    """Interpreters to ask, in order: [{python, first (sys.path entries put first), reason, pid
    (the server's, or None), unit (the systemd service's, or None), idle}]: each server's, the
    inventory's, each SGLang service's (units.services: its working directory and PYTHONPATH,
    running or not), then the idle ones that may_have_sglang: python3 on PATH, COMMON_PYTHONS,
    the users' venvs and tools (tool_pythons, in the homes of the running processes' users too),
    each server's project `.venv` (in its working directory) and the interpreter of each running
    Python process that is no server nor a server's launcher (`running`: inuse.running's ([(pid,
    python)], uids): an engine embedded in another framework, a scheduler's job may run
    SGLang), so that installs no server runs from are listed too."""
    out = [_candidate(s["python"], s["import_path"], "running server pid %d" % s["pid"], pid=s["pid"],
                      unit=s.get("unit"))
           for s in servers if s["python"]]
    if params.get("python"):
        out.append(_candidate(params["python"], [], "inventory"))
    for u in services:
        out.append(_candidate(u["python"], units.import_path(u), "systemd unit %s" % u["unit"], unit=u["unit"]))
    idle = []
    for d in os.environ.get("PATH", "/usr/bin").split(os.pathsep):
        p = os.path.join(d, "python3")
        if os.path.exists(p):
            idle.append((p, "python3 on PATH"))
            break
    idle += [(p, "common location") for pat in COMMON_PYTHONS for p in sorted(glob.glob(pat))]
    idle += tool_pythons(running[1])
    cwds = [s.get("cwd") for s in servers] + [u["cwd"] for u in services]
    idle += [(os.path.join(d, ".venv", "bin", "python"), "project venv of a server") for d in cwds if d]
    idle += [(p, "interpreter of running pid %d" % pid) for pid, p in running[0]]
    seen = set()
    for p, why in idle:
        if p not in seen and os.path.exists(p) and may_have_sglang(p):
            seen.add(p)
            out.append(_candidate(p, [], why, idle=True))
    return out


def ask(python, first, acct, timeout=LOCATE_TIMEOUT_S):
    """This probe bundle re-run as `python -I` in / as runas.Account `acct` (runas.rerun) to
    locate sglang there (see locate.locate): {python, sglang, error, torch, unreadable}. Raises
    RuntimeError when it cannot start, does not answer or cannot see its sys.path (the text says
    which account tried)."""
    who = "uid %d (%s)" % (acct.uid, acct.why)
    try:
        res, why, _ = runas.rerun(python, {"locate": first}, acct, timeout)
    except (OSError, subprocess.SubprocessError, runas.NoAccount) as e:
        raise RuntimeError("%s cannot run it: %s%s" % (who, e, FIX))
    if why:
        raise RuntimeError(why)
    if res.get("unreadable"):
        raise RuntimeError("%s cannot read %s, on its sys.path: the answer would be wrong%s"
                           % (who, ", ".join(str(e)[:300] for e in res["unreadable"][:4]), FIX))
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


def _who(acct):
    """{uid, why} of a runas.Account: what an install's entry says it was asked as."""
    return {"uid": acct.uid, "why": acct.why}


def located(python, first, store, acct):
    """ask(python, first, acct), or its answer kept in `store` (a scancache.Store, or None) while the
    _stamp it was given under still holds: a warm run starts no second interpreter. An answer
    whose sglang has no package directory is never kept. Raises what ask raises."""
    ident = json.dumps([python, list(first)])
    if store is not None:
        kept, _ = store.load(ident, "locate")
        res = kept.get("answer")
        if res and kept.get("stamp") == _stamp(python, first, (res.get("sglang") or {}).get("package_dir")):
            return res
    res = ask(python, first, acct)
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


def seen_tree(python, first):
    """The package directory `import sglang` would find for `python` with `first` put first,
    read (never run) from those entries, its site directories and the directories their `.pth`
    files name: the first holding `sglang/__init__.py`; None when none does (a PEP 660 finder,
    or no sglang there)."""
    dirs = list(first) + trust.site_dirs(python)
    dirs += [p for d in trust.site_dirs(python) for p in _pth_paths(d)]
    for d in dirs:
        if os.path.isfile(os.path.join(d, "sglang", "__init__.py")):
            return os.path.join(d, "sglang")
    return None


def _not_inspected(cand, why):
    """A not_inspected entry for candidate `cand` (candidates()) that could not be asked or did
    not answer (`why`)."""
    tree = seen_tree(cand["python"], cand["first"])
    if cand["pid"] is not None:
        what = "install of server pid %d" % cand["pid"] + (" (systemd unit %s)" % cand["unit"] if cand["unit"] else "")
    elif cand["unit"]:
        what = "install of systemd unit %s" % cand["unit"]
    else:
        what = "install %s (%s)" % (tree or os.path.dirname(os.path.dirname(cand["python"])), cand["reason"])
    return {"id": "host:" + tree if tree else None, "status": NOT_INSPECTED,
            "reason": "%s not inspected: %s: %s" % (what, cand["python"], why),
            "python": cand["python"], "servers": [], "units": []}


def asker(cand, params):
    """The runas.Account candidate `cand`'s interpreter is asked as: its server's (cand["pid"]),
    else its tree's owner (seen_tree, else the interpreter's prefix), else the inventory's
    fleetctl_unprivileged_user (params["unprivileged_user"]) or nobody. Raises runas.NoAccount."""
    python = cand["python"]
    tree = seen_tree(python, cand["first"]) or os.path.dirname(os.path.dirname(python))
    servers = [cand["pid"]] if cand["pid"] is not None else []
    return runas.account(servers, tree, params.get("unprivileged_user"))


def discover(params, servers, store=None, services=(), running=((), ())):
    """The installs on this host: ([{id, python, sglang, torch, servers: [pid], error, asked_as:
    {uid, why}: the account its interpreter was asked as (asker)}],
    [{python, reason, sglang (version or None), skipped | error}] interpreters considered,
    [{id, status: NOT_INSPECTED, reason, python, servers: [pid], units: [name]}] installs seen
    but not inspected: a server's, a service's (`services`: units.services) or an idle
    interpreter's (one that may_have_sglang) that could not be asked (no account, or one that
    cannot read it) or did not answer; `id` is "host:<package_dir>" read from its site
    directories (seen_tree; None when none is found), one entry per tree.
    Sets each server's `install` (its install id, None when its interpreter has no sglang or
    was not asked). `store`: a scancache.Store keeping interpreters' answers (see located), or
    None. An install's id is "host:<package_dir>" (or "host:<location>" when the package
    directory was not found); one tree is one install (by its real path), whichever
    interpreters reach it."""
    installs, considered, asked, unseen = {}, [], {}, {}
    for s in servers:
        s["install"] = None
    for cand in candidates(params, servers, services, running):
        python, first, pid = cand["python"], cand["first"], cand["pid"]
        key = (python, tuple(first))
        if key not in asked:
            entry = {"python": python, "reason": cand["reason"], "sglang": None}
            considered.append(entry)
            asked[key] = None
            if not os.access(python, os.X_OK):
                entry["skipped"] = "not executable"
                continue
            try:
                acct = asker(cand, params)
                asked[key] = dict(located(python, first, store, acct), asked_as=_who(acct))
                entry["sglang"] = (asked[key]["sglang"] or {}).get("version")
            except (RuntimeError, OSError, runas.NoAccount) as e:
                entry["error"] = str(e)
                asked[key] = {"failed": str(e)}
        res = asked[key]
        if res and "failed" in res:
            if cand["reason"] == "inventory" or (pid is None and not cand["idle"] and seen_tree(python, first) is None):
                continue  # the inventory's is the host's failure (gather); a service with no sglang seen
            e = _not_inspected(cand, res["failed"])
            e = unseen.setdefault(e["id"] or os.path.realpath(python), e)
            if pid is not None:
                e["servers"].append(pid)
            if cand["unit"] and cand["unit"] not in e["units"]:
                e["units"].append(cand["unit"])
            continue
        if not res or not res["sglang"]:
            continue
        sg = res["sglang"]
        iid = "host:" + (sg["package_dir"] or sg["location"])
        same = next((i for i in installs.values() if os.path.realpath(i["id"][5:]) == os.path.realpath(iid[5:])), None)
        inst = same or installs.setdefault(iid, {"id": iid, "python": dict(res["python"], path=python), "sglang": sg,
                                                 "torch": res["torch"], "servers": [], "error": res["error"],
                                                 "asked_as": res["asked_as"]})
        if pid is not None:
            inst["servers"].append(pid)
            next(s for s in servers if s["pid"] == pid)["install"] = inst["id"]
    # an idle interpreter refused where another one reached the same tree: that tree is inspected
    seen = [e for e in unseen.values() if e["servers"] or e["units"] or e["id"] not in installs]
    return list(installs.values()), considered, seen


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


def primary(installs, servers, unseen=()):
    """(the primary install or None, reason when None): the install of the server with the
    lowest pid (none when that server's install was not inspected: its entry of `unseen`, the
    not_inspected list, gives the reason); with no server, the only install, when nothing else
    was seen; otherwise none."""
    by_id = dict((i["id"], i) for i in installs)
    blocked = dict((pid, e) for e in unseen for pid in e["servers"])
    for s in sorted(servers, key=lambda s: s["pid"]):
        if s.get("install") in by_id:
            return by_id[s["install"]], None
        if s["pid"] in blocked:
            return None, blocked[s["pid"]]["reason"]
    if len(installs) == 1 and not unseen:
        return installs[0], None
    if unseen and not installs:
        more = len(unseen) - 1
        return None, unseen[0]["reason"] + ("; %d more not inspected: see not_inspected" % more if more else "")
    return None, SEVERAL if installs or unseen else NONE_FOUND


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
    deadline_s (the host's seconds left when the probe started: the host tools it runs end
    within it, bounded.start; None: each tool's own limit only),
    cache_key (sha256 of the bundled probe sources; None: no scan cache, see scancache), inside
    (bool: run in a container; {"refused": why} when this interpreter fails trust.untrusted
    there: the probe runs with -S); or
    locate ([sys.path entries]) when re-run inside an install's interpreter (see ask()).
    Returns {"facts" (with "tool_errors": bounded.errors(), each host tool that did not answer in
    time, killed or left behind), "installs", "not_inspected" (discover), "allocator_call_sites",
    "need_sort_origins", "scan", ["sources"]}, the last four (and facts.sglang/python/torch) of
    the primary install; each scanned install also carries "verify_attention_route"
    (verifyroute.route), its files' texts in its "sources" when with_sources."""
    if "locate" in params:
        res = locate.locate(params["locate"])
        res["torch"] = torchver.installed()
        return res
    bounded.start(params.get("deadline_s"))
    if params.get("inside"):
        why = trust.untrusted(sys.executable)
        if why:  # checked inside, as the container's user: its own files, planted by nobody else
            return {"refused": "interpreter %s in the container refused: %s" % (sys.executable, why)}
    servers, others = procs.find_servers(containers.host_view)
    found = containers.containers(others) if params.get("containers", True) else []
    store = scancache.Store(params["cache_key"]) if params.get("cache_key") else None
    try:
        installs, considered, unseen = discover(params, servers, store, units.services(),
                                                inuse.running(servers, containers.host_view))
        for inst in installs:
            if params.get("scan", True):
                scan_install(inst, params.get("with_sources"), store)
                if inst["scan"].get("error") is None:  # where target verify can be routed (route-verify-attention)
                    route = inst["verify_attention_route"] = verifyroute.route(
                        inst, servers, params.get("public_dir") or verifyroute.PUBLIC_DIR, params.get("with_sources"),
                        store)
                    if "sources" in route:
                        inst["sources"].update(route.pop("sources"))
            else:
                inst["scan"] = {"error": inst.pop("error")} if inst.get("error") else None
                inst.pop("error", None)
        if store:
            store.prune([i["id"] for i in installs])
            record_interpreter(store, params)
    finally:
        if store:
            store.close()
    inuse.mark(installs, servers, containers.host_view)
    main_inst, reason = primary(installs, servers, unseen)
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
        "servers_unreadable": procs.unreadable_servers(),
        "in_use": main_inst["in_use"] if main_inst else None,
        "servers_in_other_namespaces": len(others),
        "containers": found, "runtime_clis": containers.clis(),
        "tool_errors": bounded.errors(),  # host tools (nvidia-smi, systemctl, a runtime's inspect) that did not answer
        "interpreter_discovery": {"python": main_inst["python"]["path"] if main_inst else None,
                                  "reason": reason or "install %s" % main_inst["id"], "considered": considered},
    }
    out = {"facts": facts, "installs": installs, "not_inspected": unseen, "allocator_call_sites": [],
           "need_sort_origins": [], "scan": None}
    if params.get("records"):
        out["container_records"] = containers.records(params["records"])
    if main_inst:
        for k in ("allocator_call_sites", "need_sort_origins", "scan", "sources"):
            if k in main_inst:
                out[k] = main_inst[k]
    return out
