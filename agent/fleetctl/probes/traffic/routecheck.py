"""Remote probe: the route gate's run on one host (engine/gates/route.py compares two of them).

For each server target (the smoke decode's: targets.pick over the facts probe's servers, the
inventory's fleetctl_sglang_port / _host), over loopback and with the inventory's API key as the
smoke probe sends it:

1. the health wait (smoke.wait_healthy), then `/server_info` (or `/get_server_info` before 0.5):
   SERVER_INFO_KEYS, as ServerArgs names them (sglang/srt/server_args.py; 0.5.23
   http_server.py `get_server_info` answers ServerArgs plus internal states);
2. FLUSH_WAIT_S (so the calls of what ran before, the smoke gate's decode, are written and not
   counted as this check's), then the routing evidence of the server's process tree (the server
   pid and its descendants: listeners.children / tree), read_evidence() for each;
3. PROMPTS (three short texts) and one long text of at least `long_tokens` (4096) tokens, each
   POST /generate greedy (`temperature 0`, `ignore_eos`, `max_new_tokens`), `return_logprob: true,
   top_logprobs_num: 2`; the long text starts at `long_tokens` + 64 characters (the stand-in's
   byte tokenizer: one token a byte) and is grown, at most LONG_TRIES times, when the server's
   `meta_info.prompt_tokens` says its tokenizer made fewer tokens, to at most MAX_CHARS_PER_TOKEN
   characters per wanted token (a hostile count never makes it build more); a server whose context_length
   cannot hold `long_tokens` + `max_new_tokens` is not sent it (the error says so);
4. FLUSH_WAIT_S after the last request (the hook writes a dirty record within 0.25 s), the
   evidence again.

The request and answer shapes are SGLang's: GenerateReqInput (sglang/srt/managers/io_struct.py:
text, sampling_params, return_logprob, top_logprobs_num), meta_info from TokenizerManager
(sglang/srt/managers/tokenizer_manager.py of 0.5.23: `prompt_tokens`, `completion_tokens`,
`output_token_logprobs` [(logprob, token_id, text)] and `output_top_logprobs` [[(logprob,
token_id, text)] per position], `spec_verify_ct` when the server speculates (0.5.23:3172, 0.4.6.post5:1203)).
With return_logprob and the default logprob_start_len -1, SGLang computes input logprobs for
the last prompt token only (0.4.6.post5 scheduler.py:1003-1005, 0.5.23 scheduler.py:3260-3268).

Routing evidence (the hook: playbooks/templates/route-verify-attention/fleetctl_verify.py):
EVIDENCE_DIR/<uid>/<pid>.json, one JSON object per process (pid, uid, start_time, boot_id, build,
module, captured, eager_routed, fallbacks, written, trigger). Everything read from the host is hostile
and bounded: the directory is reached from / without following a link (safefs.open_dir), `<uid>`
and `<pid>.json` are opened with O_NOFOLLOW (a link is refused, never followed); the directory
must belong to the process's effective uid (/proc/PID/status `Uid:`, its second number: the
hook's geteuid()) and be writable by no one else,
the file must be a regular file of that uid of at most MAX_EVIDENCE bytes holding a JSON object
whose fields have the hook's types (strings and lists cut to bounds); its boot_id must be this
boot's (review R4-8: a pid and start tick repeat across boots) and its pid, uid and start_time the
live process's (start_time: /proc/PID/stat field 22, clock ticks after boot), else it is a stale
record (a reused pid, an earlier server, an earlier boot) and counts for nothing.

Stdlib only (Python 3.8+). Never raises for a server's or a file's faults: they land in `error`
or in an evidence entry's `state` and `why`.
"""

import errno
import json
import math
import os
import stat
import time

from . import smoke
from .. import evidence, redact, runas, safefs
from ..facts import listeners

FLUSH_WAIT_S = 1.0  # seconds after the last request before the evidence is read again
MAX_EVIDENCE = 64 << 10  # bytes of one evidence file read at most
EVIDENCE_SUBDIR = "route-evidence"  # under config.PUBLIC_KERNELS_DIR
LONG_TOKENS = 4096  # the long prompt's least prompt_tokens (split paths run: the issue)
LONG_TRIES = 3  # long prompts sent at most to reach LONG_TOKENS
MAX_CHARS_PER_TOKEN = 16  # the long prompt's characters per wanted token at most (English BPE makes about 4)
MAX_NEW_TOKENS = 24
MAX_TREE = 256  # processes of one server's tree read at most
MAX_STR = 512  # characters kept of a string field of an evidence record
MAX_CAPTURED = 256  # captured shapes kept of one record
MAX_FALLBACKS = 64  # fallback reasons kept of one record
# the fixed short prompts (texts: a real server tokenizes them itself); repetitive, so a prompt-
# lookup draft (NGRAM) finds continuations to verify
PROMPTS = (
    ("fox", "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
            "The quick brown fox"),
    ("count", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,"),
    ("code", "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"),
)
LONG = "long"
# /server_info keys the gate reads (ServerArgs field names) and the types they must have
SERVER_INFO_KEYS = (("tp_size", int), ("pp_size", int), ("dp_size", int), ("enable_dp_attention", bool),
                    ("nnodes", int), ("context_length", int), ("speculative_algorithm", str),
                    ("speculative_num_draft_tokens", int))
_WORDS = ("the", "route", "gate", "reads", "every", "rank", "kernel", "draft", "token", "verify", "cache",
          "page", "head", "group", "batch", "prefix", "split", "graph", "server", "host")


def long_text(chars):
    """A deterministic English-like text of exactly `chars` characters (a numbered sentence of
    _WORDS picked by a fixed linear congruential sequence, repeated with other numbers and picks):
    the same text on every host and run."""
    out, n, x = [], 0, 12345
    i = 0
    while n < chars:
        words = []
        for _ in range(6):
            x = (x * 1103515245 + 12345) % (1 << 31)
            words.append(_WORDS[(x >> 16) % len(_WORDS)])
        s = "Line %d: %s. " % (i, " ".join(words))
        out.append(s)
        n += len(s)
        i += 1
    return "".join(out)[:chars]


# ---- /proc -------------------------------------------------------------------------------

def _read_proc(path):
    try:
        with open(path, "rb") as f:
            return f.read(16384).decode("utf-8", "replace")
    except OSError:
        return None


def boot_id():
    """This boot's id: /proc/sys/kernel/random/boot_id (random(4)), or None when unread."""
    s = (_read_proc("/proc/sys/kernel/random/boot_id") or "").strip()[:64]
    return s or None


def start_time(pid):
    """Process `pid`'s start time: /proc/PID/stat field 22 (clock ticks after boot, proc(5)),
    read after the last `)` (the name may hold any character); None when it cannot be read."""
    s = _read_proc("/proc/%d/stat" % pid)
    try:
        return int(s.rsplit(")", 1)[1].split()[19])
    except (AttributeError, IndexError, ValueError):
        return None


def process_tree(pid):
    """[pid, its descendants...] as /proc says now (at most MAX_TREE)."""
    return listeners.tree(pid, listeners.children())[:MAX_TREE]


# ---- the evidence --------------------------------------------------------------------------

class Bad(ValueError):
    """An evidence record that is not what the hook writes; the message says which field."""


def _int(v, name):
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise Bad("%s is not a non-negative integer" % name)
    return v


def _str(v, name, limit=MAX_STR):
    if not isinstance(v, str):
        raise Bad("%s is not a string" % name)
    return redact.text(v[:limit])


def sanitize(rec):
    """The fields of evidence record `rec` (parsed JSON) the gate reads, type-checked and cut to
    bounds: {pid, uid, start_time, boot_id, build, module, captured: [{batch, draft_tokens, head_dim, group,
    dtype}], captured_total, eager_routed, fallbacks: {reason: calls}, written, trigger}. Raises
    Bad naming the first field that is missing or of another type."""
    if not isinstance(rec, dict):
        raise Bad("not a JSON object")
    out = {k: _int(rec.get(k), k) for k in ("pid", "uid", "start_time", "eager_routed")}
    out["boot_id"] = _str(rec.get("boot_id"), "boot_id", 64) if rec.get("boot_id") is not None else None
    out["build"] = _str(rec.get("build"), "build") if rec.get("build") is not None else None
    out["module"] = _str(rec.get("module"), "module") if rec.get("module") is not None else None
    cap = rec.get("captured")
    if not isinstance(cap, list):
        raise Bad("captured is not a list")
    out["captured"], out["captured_total"] = [], len(cap)
    for c in cap[:MAX_CAPTURED]:
        if not isinstance(c, dict):
            raise Bad("a captured entry is not an object")
        e = {k: _int(c.get(k), "captured " + k) for k in ("batch", "draft_tokens", "head_dim", "group")}
        e["dtype"] = _str(c.get("dtype"), "captured dtype", 32)
        out["captured"].append(e)
    fb = rec.get("fallbacks")
    if not isinstance(fb, dict):
        raise Bad("fallbacks is not an object")
    out["fallbacks"] = {}
    for k, v in list(fb.items())[:MAX_FALLBACKS]:
        out["fallbacks"][_str(k, "a fallback reason", 200)] = _int(v, "fallbacks count")
    w = rec.get("written")
    out["written"] = w if isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) else None
    out["trigger"] = _str(rec.get("trigger"), "trigger", 32) if isinstance(rec.get("trigger"), str) else None
    return out


def _open_at(dfd, name, flags, path):
    """os.open(name, flags | O_NOFOLLOW, dir_fd=dfd): (fd, None), (None, "missing"), or (None,
    why) for a link or anything else that cannot be opened."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd), None
    except OSError as e:
        if e.errno == errno.ENOENT:
            return None, "missing"
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            kind = safefs.kind_of(st.st_mode)
        except OSError:
            kind = None
        if kind == "symlink" or e.errno == errno.ELOOP:
            return None, "%s is a symbolic link: not followed" % path
        return None, "%s: %s" % (path, kind if e.errno == errno.ENOTDIR and kind else e.strerror)


def read_record(directory, uid, pid):
    """Read `directory`/<uid>/<pid>.json (module docstring): (state, why, parsed JSON or None).
    state "read" (JSON parsed, not yet checked), "missing" (no directory or file), "refused"
    (a link, another owner, a writable directory, not a regular file, over MAX_EVIDENCE, not JSON)."""
    try:
        dfd = safefs.open_dir(directory)
    except FileNotFoundError:
        return "missing", "no %s" % directory, None
    except (safefs.UnsafePath, OSError) as e:
        return "refused", str(e), None
    try:
        upath = "%s/%d" % (directory, uid)
        ufd, why = _open_at(dfd, str(uid), os.O_RDONLY | os.O_DIRECTORY, upath)
        if ufd is None:
            return ("missing", "no %s" % upath, None) if why == "missing" else ("refused", why, None)
        try:
            st = os.fstat(ufd)
            if st.st_uid != uid:
                return "refused", "%s belongs to uid %d, not the process's uid %d" % (upath, st.st_uid, uid), None
            if st.st_mode & 0o022:
                return "refused", "%s is writable by group or others (mode %o)" % (upath, stat.S_IMODE(st.st_mode)), None
            fpath = "%s/%d.json" % (upath, pid)
            fd, why = _open_at(ufd, "%d.json" % pid, os.O_RDONLY | os.O_NONBLOCK, fpath)
            if fd is None:
                return ("missing", "no %s" % fpath, None) if why == "missing" else ("refused", why, None)
            with os.fdopen(fd, "rb") as f:
                fst = os.fstat(f.fileno())
                if not stat.S_ISREG(fst.st_mode):
                    return "refused", "%s is a %s, not a regular file" % (fpath, safefs.kind_of(fst.st_mode)), None
                if fst.st_uid != uid:
                    return "refused", "%s belongs to uid %d, not the process's uid %d" % (fpath, fst.st_uid, uid), None
                data = f.read(MAX_EVIDENCE + 1)
            if len(data) > MAX_EVIDENCE:
                return "refused", "%s is over %d bytes" % (fpath, MAX_EVIDENCE), None
            try:
                return "read", None, json.loads(data.decode("utf-8"))
            except (ValueError, RecursionError) as e:  # not JSON, or nested past the parser's depth
                return "refused", "%s is not JSON: %s" % (fpath, str(e)[:100]), None
        finally:
            os.close(ufd)
    finally:
        os.close(dfd)


def read_evidence(directory, pid):
    """The routing evidence of process `pid`: {pid, uid (effective, runas.ids_of: the uid the hook
    writes as, review R4-6), start_time (/proc), state,
    why, record}. state: "fresh" (a record of this very process: sanitize()'s fields in record),
    "stale" (a record of another process that had this pid, or of another uid: record kept, not
    counted), "missing", "refused" (read_record, sanitize), "gone" (the process exited)."""
    ids, st = runas.ids_of(pid), start_time(pid)
    uid = ids[0] if ids else None
    out = {"pid": pid, "uid": uid, "start_time": st, "state": "gone", "why": "the process exited", "record": None}
    if uid is None or st is None:
        return out
    state, why, rec = read_record(directory, uid, pid)
    if state != "read":
        out.update(state=state, why=why)
        return out
    try:
        rec = sanitize(rec)
    except Bad as e:
        out.update(state="refused", why="%s/%d/%d.json: %s" % (directory, uid, pid, e))
        return out
    out["record"] = rec
    boot = boot_id()
    if rec["boot_id"] != boot:
        out.update(state="stale", why="the record is of boot %s; this is boot %s (a record of an earlier boot, or "
                                      "of a hook before boot ids: fleetctl apply route-verify-attention writes one "
                                      "that names it)" % (rec["boot_id"], boot))
        return out
    if (rec["pid"], rec["uid"], rec["start_time"]) != (pid, uid, st):
        out.update(state="stale", why="the record is of pid %d uid %d start_time %d; this process is uid %d "
                                      "start_time %d" % (rec["pid"], rec["uid"], rec["start_time"], uid, st))
        return out
    out.update(state="fresh", why=None)
    return out


def tree_evidence(directory, pid):
    """read_evidence of each process of `pid`'s tree (process_tree), those with no record left out
    unless it is `pid` itself: [entry]."""
    out = []
    for p in process_tree(pid):
        e = read_evidence(directory, p)
        if p == pid or e["state"] != "missing":
            out.append(e)
    return out


# ---- the requests -------------------------------------------------------------------------

def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def parse_answer(status, out, n):
    """One /generate answer for max_new_tokens `n` -> {output_ids, prompt_tokens, completion_tokens,
    spec_verify_ct, logprobs: [logprob of each output token], top2: [[[logprob, id], ...] top-2 per
    position], error}; lists cut to 4 n + 16 entries, numbers type-checked (None where not)."""
    res = {"output_ids": None, "prompt_tokens": None, "completion_tokens": None, "spec_verify_ct": None,
           "logprobs": None, "top2": None, "error": None}
    if status != 200 or not isinstance(out, dict):
        res["error"] = redact.text("/generate answered HTTP %s: %s" % (status, json.dumps(out)[:300]))
        return res
    cap = 4 * n + 16
    meta = out.get("meta_info") if isinstance(out.get("meta_info"), dict) else {}
    ids = out.get("output_ids")
    if isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids[:cap]):
        res["output_ids"] = ids[:cap]
    for k in ("prompt_tokens", "completion_tokens", "spec_verify_ct"):
        v = meta.get(k)
        res[k] = v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None
    lps = meta.get("output_token_logprobs")
    if isinstance(lps, list):
        res["logprobs"] = [_num(e[0]) if isinstance(e, (list, tuple)) and e else None for e in lps[:cap]]
    tops = meta.get("output_top_logprobs")
    if isinstance(tops, list):
        res["top2"] = [[[_num(t[0]), t[1] if isinstance(t[1], int) else None] for t in pos[:2]
                        if isinstance(t, (list, tuple)) and len(t) >= 2] if isinstance(pos, list) else []
                       for pos in tops[:cap]]
    problems = []
    if res["output_ids"] is None:
        problems.append("no output_ids")
    elif len(res["output_ids"]) != n:
        problems.append("expected %d output_ids, got %d" % (n, len(res["output_ids"])))
    if res["logprobs"] is None or res["top2"] is None:
        problems.append("no output_token_logprobs / output_top_logprobs in meta_info (return_logprob)")
    if res["prompt_tokens"] is None:
        problems.append("no meta_info.prompt_tokens")
    if problems:
        res["error"] = "; ".join(problems)
    return res


def generate(base, text, n, timeout):
    """POST base/generate of `text` (greedy, n new tokens, ignore_eos, logprobs top 2): parse_answer's dict."""
    body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2}
    try:
        status, out = smoke._request(base + "/generate", body, timeout=timeout)
    except OSError as e:
        status, out = None, {"error": str(getattr(e, "reason", None) or e)}
    return parse_answer(status, out, n)


def server_info(base, timeout):
    """SERVER_INFO_KEYS of base/server_info (or /get_server_info), each None when absent or of
    another type; None when neither answers an object."""
    for path in ("/server_info", "/get_server_info"):
        try:
            status, body = smoke._request(base + path, timeout=timeout)
        except OSError:
            continue
        if status == 200 and isinstance(body, dict):
            info = {}
            for k, kind in SERVER_INFO_KEYS:
                v = body.get(k)
                ok = isinstance(v, kind) and (kind is bool or not isinstance(v, bool))
                info[k] = (v[:64] if isinstance(v, str) else v) if ok else None
            return info
    return None


def long_prompt(base, n, long_tokens, context, timeout):
    """The long prompt: long_text of long_tokens + 64 characters, grown (at most LONG_TRIES sends)
    while the server's prompt_tokens is under long_tokens. Returns generate()'s dict + name, chars,
    tries; error when it could not reach long_tokens or the context cannot hold it (not sent)."""
    res = {"name": LONG, "chars": 0, "tries": 0}
    if context is not None and context < long_tokens + n:
        res.update(parse_answer(None, None, n), error="the server's context_length %d cannot hold a %d-token prompt "
                                                      "and %d new tokens: not sent" % (context, long_tokens, n))
        return res
    chars = long_tokens + 64
    for _ in range(LONG_TRIES):
        res["chars"], res["tries"] = chars, res["tries"] + 1
        res.update(generate(base, long_text(chars), n, timeout))
        got = res["prompt_tokens"]
        if res["error"] or got >= long_tokens:
            return res
        want = int(long_tokens * 1.05) + 8
        if context is not None:
            want = min(want, context - n - 8)
        limit = MAX_CHARS_PER_TOKEN * long_tokens + 64  # a server's count never makes the probe build more
        grown = min(limit, max(chars + 64, int(math.ceil(chars * want / max(1, got)))))
        if grown <= chars:
            break
        chars = grown
    res["error"] = "the long prompt made %d tokens after %d tries (%d characters, at most %d sent), fewer than %d" % (
        res["prompt_tokens"], res["tries"], res["chars"], MAX_CHARS_PER_TOKEN * long_tokens + 64, long_tokens)
    return res


def _result(t):
    return {"host": t["host"], "port": int(t["port"]), "pid": t.get("pid"), "node_rank": t.get("node_rank", 0),
            "ok": False, "error": None, "health_wait_s": None, "server_info": None, "prompts": [],
            "evidence": {"before": [], "after": []}, "duration_s": None}


def route_server(t, directory, health_timeout=60.0, request_timeout=60.0, max_new_tokens=MAX_NEW_TOKENS,
                 long_tokens=LONG_TOKENS, flush_wait_s=FLUSH_WAIT_S, exited=None):
    """The route check of one target `t` ({pid, host, port, node_rank}: targets.pick), evidence
    from `directory` (PUBLIC/route-evidence). Seconds throughout. Returns {host, port, pid,
    node_rank, ok, error, health_wait_s, server_info (server_info()), prompts: [{name, chars,
    ...generate()'s}], evidence: {before, after: tree_evidence()}, duration_s}; ok when every
    prompt answered and the long one reached long_tokens. `exited`: smoke.wait_healthy's
    (smoke.watch). Never raises for a server's faults."""
    t0 = time.monotonic()
    res = _result(t)
    host = t["host"]
    base = "http://%s:%d" % (host if ":" not in host else "[%s]" % host, int(t["port"]))
    healthy, waited, why = smoke.wait_healthy(base, health_timeout, request_timeout, exited)
    res["health_wait_s"], res["pid"] = round(waited, 3), t.get("pid")  # a successor's, when `exited` followed one
    if not healthy:
        res["error"] = why
        return res
    if res["node_rank"] >= 1:
        res["error"] = ("node rank %d serves /health only (SGLang's dummy health server): the route gate decodes "
                        "through /generate of rank 0, which this gate does not reach; not gated" % res["node_rank"])
        return res
    info = server_info(base, request_timeout)
    res["server_info"] = info
    if info is None:
        res["error"] = "neither /server_info nor /get_server_info answered"
        return res
    pid = t.get("pid")
    if flush_wait_s > 0:
        time.sleep(flush_wait_s)  # the calls before this check (the smoke gate's) written: not counted as its own
    if pid is not None:
        res["evidence"]["before"] = tree_evidence(directory, pid)
    for name, text in PROMPTS:
        answer = generate(base, text, max_new_tokens, request_timeout)
        res["prompts"].append(dict(name=name, chars=len(text), tries=1, **answer))
    res["prompts"].append(long_prompt(base, max_new_tokens, long_tokens, info.get("context_length"), request_timeout))
    if flush_wait_s > 0:
        time.sleep(flush_wait_s)  # the hook's flush thread writes within 0.25 s
    if pid is not None:
        res["evidence"]["after"] = tree_evidence(directory, pid)
    errors = ["%s: %s" % (p["name"], p["error"]) for p in res["prompts"] if p["error"]]
    res["error"] = "; ".join(errors) or None
    res["ok"] = not errors
    res["duration_s"] = round(time.monotonic() - t0, 3)
    return res


def _prepare_evidence(directory, pids):
    """As root, make `directory` (PUBLIC/route-evidence) and its directory for each effective uid
    of `pids` (evidence.prepare: review R4-5), before a change makes the hook write there; where
    PUBLIC is missing (no kernel published) or cannot be reached safely, nothing: the evidence
    read says what is missing."""
    if os.geteuid() != 0:
        return
    try:
        pub = safefs.open_dir(os.path.dirname(directory))
    except (OSError, safefs.UnsafePath):
        return
    try:
        evidence.prepare(pub, pids, os.path.dirname(directory))
    except (OSError, safefs.UnsafePath, evidence.Refused):
        pass
    finally:
        os.close(pub)


def main(params):
    """Probe entry point. params: servers (targets.live selectors: the smoke decode's), port, host
    (the inventory's choice), api_key (sent as a bearer token to the targets only, never
    returned), evidence_dir (absolute: config.PUBLIC_KERNELS_DIR + "/route-evidence"),
    health_timeout (60 s), request_timeout (60 s), max_new_tokens (24), long_tokens (4096),
    flush_wait_s (FLUSH_WAIT_S). As root it first makes the evidence directories of the targets'
    processes (_prepare_evidence). Returns {"servers": [route_server()], "refused": [targets.select's
    refusals: nothing was sent], "evidence_dir"}; a server that never listened: ok false, why in error."""
    smoke.API_KEY = params.get("api_key")
    health_timeout = float(params.get("health_timeout", 60))
    directory = params["evidence_dir"]
    picked, waited = smoke.choose(params.get("servers") or [], params.get("port"), params.get("host"), health_timeout,
                                  params.get("server_user"))
    _prepare_evidence(directory, [p for t in picked["targets"] for p in process_tree(t["pid"])])
    servers = []
    for t in picked["targets"]:
        servers.append(route_server(t, directory, health_timeout=max(0.0, health_timeout - waited),
                                    request_timeout=float(params.get("request_timeout", 60)),
                                    max_new_tokens=int(params.get("max_new_tokens", MAX_NEW_TOKENS)),
                                    long_tokens=int(params.get("long_tokens", LONG_TOKENS)),
                                    flush_wait_s=float(params.get("flush_wait_s", FLUSH_WAIT_S)),
                                    exited=smoke.watch(params.get("servers") or [], params.get("port"),
                                                       params.get("host"), params.get("server_user"), t)))
    for p in picked["pending"]:
        servers.append(dict(_result(p), error=smoke.pending_error(p, health_timeout, waited)))
    for s in servers:
        s["error"] = redact.text(s["error"])
    return {"servers": servers, "refused": picked["refused"], "evidence_dir": directory}
