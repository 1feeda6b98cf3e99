"""Diagnose probe (stdlib only, Python 3.8+): one bounded profile of each server, its expert
distribution recorded over the same window, read back as the server's uid, the server left
profiling and recording nothing.

For each server (targets.pick: the smoke decode's rule, loopback or this host's own addresses
only), one after another:

1. leftovers: a private directory of an earlier run on this server's port that was killed
   (PREFIX, owned by the server's uid) means that run may have left the server profiling or
   recording: /stop_profile and /stop_expert_distribution_record are sent first and the
   directory removed (stop_leftovers);
2. a private directory for this run, /tmp/PREFIX<port>-<random> (mode 0700, made by root in
   its sticky /tmp, given to the server's uid: runas.account); a guard process (its own session)
   watches this probe and, if it dies before its end, sends both stops and removes the directory
   within GUARD_POLL_S;
3. with `load`, the load gate's client (traffic/load.load_server: SGLang's own benchmark client,
   as the server's uid) starts in a thread, so the profile sees decode steps;
4. /start_expert_distribution_record, then /start_profile with that output_dir, num_steps,
   activities CPU and GPU and (0.5.2+) a profile_id of ours (ProfileReq: 0.5.23
   srt/managers/io_struct.py:2374); the probe waits until the trace file is written and stops
   growing, or `seconds` pass (then /stop_profile makes the server write what it has). Not
   profile_by_stage: a by-stage profile starts only at its stage's first batch, and a
   /stop_profile before that answers "not in progress" and leaves it pending (0.5.23
   srt/managers/scheduler_components/profiler_manager.py:325-329, 413-446): an idle server would
   start profiling at its next request, after fleetctl is gone. So the trace holds the
   num_steps forward passes after the start, prefills among them;
5. /stop_expert_distribution_record, /dump_expert_distribution_record (0.5.23
   srt/entrypoints/http_server.py:1267-1293), /server_info (the pool size, speculative accept
   length, ep_size) and the KV pool's usage (_info);
6. always (finally): /stop_profile and /stop_expert_distribution_record (an answer that says
   nothing is in progress is fine), the guard told to go;
7. the child (child.py) reads the trace and the dump as the server's uid (a server running as
   root: as runas.account's other account, the directory then that account's); the directory
   and the dumps this run caused are removed.
"""

import glob
import os
import signal
import stat
import tempfile
import threading
import time

from .. import runas
from ..facts import targets
from ..traffic import load, smoke
from . import child

PREFIX = "fleetctl-diagnose-"
PARENT = "/tmp"
GUARD_POLL_S = 0.5
STOPS = ("/stop_profile", "/stop_expert_distribution_record")
STABLE_S = 0.6  # a trace file whose size stays the same this long is written
REQUEST_TIMEOUT_S = 30.0
INFO_KEYS = ("version", "max_total_num_tokens", "speculative_algorithm", "ep_size", "tp_size", "dp_size",
             "enable_ep_moe", "ep_num_redundant_experts", "expert_distribution_recorder_mode", "page_size")


def _base(t):
    return "http://%s:%d" % (t["host"] if ":" not in t["host"] else "[%s]" % t["host"], int(t["port"]))


def _post(base, path, body=None, timeout=REQUEST_TIMEOUT_S):
    """(HTTP status, text of the answer up to 300 characters) or (None, why)."""
    try:
        status, answer = smoke._request(base + path, body if body is not None else {}, timeout=timeout)
    except OSError as e:
        return None, str(e)[:300]
    return status, ("" if answer is None else str(answer))[:300]


def stop_all(base):
    """Send STOPS to `base`; returns {path: status or None}."""
    return {p: _post(base, p, timeout=10.0)[0] for p in STOPS}


def stop_leftovers(t, uid):
    """Directories of killed earlier runs on `t`'s port owned by `uid`: both stops sent once to
    `t` when there is any, each removed (runas.remove). Returns their names."""
    found = []
    for path in glob.glob(os.path.join(PARENT, "%s%d-*" % (PREFIX, int(t["port"])))):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
            found.append(path)
    if found:
        stop_all(_base(t))
        for path in found:
            runas.remove(path)
    return [os.path.basename(p) for p in found]


def guard(base, path, watched):
    """Fork a guard in its own session: while process `watched` lives it sleeps; when it is gone
    and `path` still exists (the probe died before its end), it sends STOPS to `base` and removes
    `path`. Returns the guard's pid (the probe kills it at its end)."""
    pid = os.fork()
    if pid:
        return pid
    try:  # the guard: nothing but the watch
        os.setsid()
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        for fd in (0, 1, 2):
            try:
                os.close(fd)
            except OSError:
                pass
        while True:
            try:
                os.kill(watched, 0)
            except ProcessLookupError:
                break
            time.sleep(GUARD_POLL_S)
        if os.path.lexists(path):
            stop_all(base)
            runas.remove(path)
    finally:
        os._exit(0)


def _wait_trace(path, seconds):
    """Wait until a *.trace.json[.gz] file in `path` exists and its size is unchanged for
    STABLE_S, at most `seconds`. Returns True when one was written."""
    end = time.monotonic() + seconds
    last = None
    while time.monotonic() < end:
        try:
            names = [n for n in os.listdir(path) if child.TRACE_NAME.match(n)]
            size = tuple(sorted((n, os.lstat(os.path.join(path, n)).st_size) for n in names))
        except OSError:
            names, size = [], None
        if names and size == last:
            return True
        last = size
        time.sleep(STABLE_S)
    return False


def remove_dumps(recorder, names, uid):
    """Remove the recorder's dumps this run caused: `names` (the child's, each matching
    child.DUMP_NAME) in directory `recorder`, each a regular file of the server's `uid` (never
    through a link: unlink at the directory's descriptor, reached by safefs.open_dir). Returns the
    newest name, or None."""
    names = [n for n in names or [] if isinstance(n, str) and child.DUMP_NAME.match(n)]
    if not names or not recorder or uid is None:
        return names[-1] if names else None
    try:
        dfd = child.safefs.open_dir(recorder)
    except (OSError, child.safefs.UnsafePath):
        return names[-1]
    try:
        for n in names:
            st = child.safefs.lstat(dfd, n)
            if st is not None and stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                try:
                    os.unlink(n, dir_fd=dfd)
                except OSError:
                    pass
    finally:
        os.close(dfd)
    return names[-1]


def _recorder_dir(pid):
    """The server's SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR (its /proc/PID/environ: load._environ),
    else SGLang's default /tmp; None when it is not an absolute normalised path."""
    d = (load._environ(pid) or {}).get("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR") or "/tmp"
    return d if d.startswith("/") and os.path.normpath(d) == d else None


def _number(v, top=1e12):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < top else None


def _info(base):
    """INFO_KEYS of /server_info, with internal_states[0]'s avg_spec_accept_length; and the KV
    pool's usage: "token_usage" (used / total KV slots) from /v1/loads (0.5.23
    srt/entrypoints/v1_loads.py:96, LoadSnapshot.token_usage: load_inquirer.py:243) where it
    answers, else "kv_load" (0.5.2's internal_states[0]["load"], KV slots held plus the waiting
    prompts' tokens: managers/scheduler.py:2209-2229, over max_total_num_tokens). Each a number in
    range, else None: {key: value}."""
    try:
        status, body = smoke._request(base + "/server_info", timeout=REQUEST_TIMEOUT_S)
    except OSError:
        status, body = None, None
    if status != 200 or not isinstance(body, dict):
        return {}
    out = {k: body.get(k) for k in INFO_KEYS if isinstance(body.get(k), (int, float, str, bool))}
    states = body.get("internal_states")
    st = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    out["avg_spec_accept_length"] = _number(st.get("avg_spec_accept_length"), 1e6)
    total, load_ = _number(out.get("max_total_num_tokens")), _number(st.get("load"))
    out["kv_load"] = load_ / total if load_ is not None and total else None
    out["token_usage"] = None
    try:
        status, loads = smoke._request(base + "/v1/loads?include=core", timeout=REQUEST_TIMEOUT_S)
    except OSError:
        status, loads = None, None
    rows = loads.get("loads") if status == 200 and isinstance(loads, dict) else None
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
        out["token_usage"] = _number(rows[0].get("token_usage"), 1.0 + 1e-9)
    return {k: (v[:100] if isinstance(v, str) else v) for k, v in out.items()}


def _profile_body(version, path, num_steps, tag):
    """The /start_profile body for release `version`: output_dir, num_steps, activities, and
    (0.5.2+, io_struct ProfileReq) profile_id; never profile_by_stage (module docstring)."""
    body = {"output_dir": path, "num_steps": num_steps, "activities": ["CPU", "GPU"]}
    if child.trace.kernels._vt(version) >= (0, 5, 2):
        body["profile_id"] = tag
    return body


def diagnose_server(t, sel, params):
    """One server's measurement (module docstring). Returns {pid, host, port, version, ran_as,
    leftovers, server_info, trace, trace_file, trace_error, experts, dump_file, experts_error,
    load (the load client's entry or None), stopped: {path: status}, error}."""
    out = {"pid": t["pid"], "host": t["host"], "port": int(t["port"]), "version": sel.get("version"), "ran_as": None,
           "leftovers": [], "server_info": {}, "trace": None, "trace_file": None, "trace_error": None,
           "experts": None, "dump_file": None, "experts_error": None, "load": None, "stopped": {}, "error": None}
    base = _base(t)
    python = sel.get("python")
    try:
        acct = runas.account([t["pid"]], sel.get("package_dir"), params.get("unprivileged_user"))
    except runas.NoAccount as e:
        out["error"] = "the server's files are read as its uid, never root: %s" % e
        return out
    out["ran_as"] = {"uid": acct.uid, "why": acct.why}
    out["leftovers"] = stop_leftovers(t, acct.uid)
    healthy, _, why = smoke.wait_healthy(base, float(params.get("health_timeout", 60)))
    if not healthy:
        out["error"] = "%s (nothing started)" % why
        return out
    out["server_info"] = _info(base)
    version = sel.get("version") or out["server_info"].get("version")
    seconds, steps = float(params.get("seconds", 20)), int(params.get("num_steps", 20))
    path = tempfile.mkdtemp(prefix="%s%d-" % (PREFIX, int(t["port"])), dir=PARENT)
    if os.geteuid() == 0:
        os.chown(path, acct.uid, acct.gid)
    g = guard(base, path, os.getpid())
    lthread, lout, recording, since = None, {}, False, time.time()
    recorder = _recorder_dir(t["pid"])
    try:
        if params.get("load"):
            lparams = dict(params["load"], api_key=params.get("api_key"),
                           unprivileged_user=params.get("unprivileged_user"))
            lthread = threading.Thread(target=lambda: lout.update(
                load.load_server(t, sel, lparams, float(params["load"].get("timeout", seconds + 30)))), daemon=True)
            lthread.start()
        status, text = _post(base, "/start_expert_distribution_record")
        recording = status == 200
        body = _profile_body(version, path, steps, os.path.basename(path))
        # 0.4.6.post5 answers a start with num_steps only once the profile has stopped
        # (managers/scheduler.py:2140-2145): the answer may take the whole window
        status, text = _post(base, "/start_profile", body, timeout=seconds + REQUEST_TIMEOUT_S)
        if status != 200:
            out["error"] = "/start_profile answered %s: %s" % (status, text)
        elif not _wait_trace(path, seconds):
            _post(base, "/stop_profile")  # the server writes what it profiled
            _wait_trace(path, 10.0)
        _post(base, "/stop_expert_distribution_record")
        since = time.time()
        if recording and recorder:
            _post(base, "/dump_expert_distribution_record")
        info = _info(base)
        out["server_info"] = info or out["server_info"]
    finally:
        out["stopped"] = stop_all(base)
        if lthread is not None:
            lthread.join(float(params["load"].get("timeout", seconds + 30)) + 5)
            out["load"] = lout or None
        try:
            os.kill(g, signal.SIGKILL)
            os.waitpid(g, 0)
        except OSError:
            pass
    try:
        info = out["server_info"]
        ids = runas.ids_of(t["pid"])
        got, why, _ = runas.rerun(python, {"action": "read", "trace_dir": path,
                                           "recorder_dir": recorder if recording else None, "since": since,
                                           "version": version, "speculative": bool(info.get("speculative_algorithm")),
                                           "ep_size": info.get("ep_size") or 1,
                                           "server_uid": ids[0] if ids else None},
                                  acct, float(params.get("read_timeout", 120)))
        if got is None:
            out["error"] = out["error"] or "the reading child: %s" % why
        else:
            out.update({k: got.get(k) for k in ("trace", "trace_file", "trace_error", "experts", "experts_error")})
            out["dump_file"] = remove_dumps(recorder, got.get("dump_files"), ids[0] if ids else None)
    except (OSError, runas.NoAccount) as e:
        out["error"] = out["error"] or "the reading child could not start: %s" % e
    finally:
        runas.remove(path)
    return out


def main(params):
    """params: {"action": "read" (the child: child.read) or absent, "servers": selectors ([{pid,
    python, port, host, package_dir, version}]: engine/load.load_targets), "port", "host",
    "server_user", "api_key" (sent to the servers only, never returned), "unprivileged_user",
    "health_timeout" (seconds a server gets to answer /health before anything is started),
    "seconds" (the profile's wall-clock bound), "num_steps" (its decode-step bound), "load"
    (None, or the load probe's {profile, given, client, timeout})}.
    Returns {"servers": [diagnose_server's], "refused": targets' refusals}."""
    if params.get("action") == "read":
        return child.read(params)
    smoke.API_KEY = params.get("api_key")
    selectors = params.get("servers") or []
    picked = targets.pick(selectors, params.get("port"), params.get("host"), params.get("server_user"))
    out = []
    for t in picked["targets"]:
        if t.get("node_rank"):
            continue  # a non-zero-rank node serves /health only: rank 0 is profiled
        sel = next((s for s in selectors if s.get("pid") == t["pid"]), None) or \
            next((s for s in selectors if int(s.get("port") or 0) == t["port"]), {})
        out.append(diagnose_server(t, sel, params))
    return load.scrub({"servers": out, "refused": picked["refused"]}, params.get("api_key"))
