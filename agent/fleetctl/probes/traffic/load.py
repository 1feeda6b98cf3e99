"""Load probe (remote side, stdlib only, Python 3.8+): SGLang's own benchmark client against each server.

For every target the target rule picks (targets.py, through smoke.choose: the same servers and
sockets the smoke decode talks to), the probe runs SGLang's serving benchmark client from that
server's own install with that server's own interpreter, never a client of fleetctl's:

- `python -m sglang.benchmark.serving` where the install has it (0.5.23: sglang/benchmark/serving.py),
  else `python -m sglang.bench_serving` (0.4.6 to 0.5.10), else, where the install ships the Rust
  port (0.5.23: sglang/benchmark/rust_client.py and sglang/srt/rust_extensions/_bench*.so),
  `python -m sglang.benchmark.rust_client`. A client that cannot start (an import error) passes to
  the next; when none can run the server's entry says `not_run` and why: nothing else is measured.
- The workload (PROFILES, sized by `workload`): a closed loop at a fixed concurrency
  (`--request-rate inf --max-concurrency C`), `random-ids` prompts (no corpus download) of
  lengths drawn from [L/2, L] (`--random-range-ratio 0.5`), a fixed `--seed`, `--warmup-requests C`,
  `--flush-cache` after the warm-up, `--num-prompts N` requests, streaming `/generate`
  (`--backend sglang`). The `pressure` profile is sized from the server's `/server_info`
  `max_total_num_tokens` so the demand in flight reaches about PRESSURE_DEMAND x the KV pool.
- The run: its own session and process group, cwd and HOME a fresh 0700 temp directory (the
  result file is written there, `--output-file`), stdin /dev/null, killed with its whole group
  at the deadline (inside a container also under `timeout -k`, so it ends there even if this probe
  does not), the temp directory removed after. Its environment is built from nothing:
  HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 (no Hub calls), no proxy variables and NO_PROXY for
  loopback (the client's `requests` honours http_proxy), the server's HF cache locations (its
  /proc/PID/environ) so that a Hub id resolves offline, and the API key as OPENAI_API_KEY only
  (never in argv: SGLang's clients send it as `Authorization: Bearer`).
- Who runs it: a client is SGLang code from the server's install, so it never runs as root
  (runas.account: the server's effective uid, gid and groups when that is not root, else the
  install's owner, else nobody or the inventory's fleetctl_unprivileged_user; the entry's
  `ran_as` says which); an account that cannot read what the client needs (the model's
  tokenizer under a root-only directory) fails the run with the client's own error.
- The answer: the client's result line (SGLang's own key names, the same in every release:
  0.4.6 bench_serving.py:1398-1434, 0.5.2 :1864-1887, 0.5.10 :1564-1591, 0.5.23
  benchmark/serving.py:1855-1907) read back by `parse_result`: its numbers, plus `requested`
  and `failed` (the clients exit 0 when requests fail: completed is counted against the number
  asked), the first errors, and the client's copy of /server_info with its secrets redacted
  (0.5.23 copies ServerArgs, api_key included).
"""

import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request

from . import smoke
from ..facts import listeners
from .. import redact, runas

# Workload profiles: concurrency, num_prompts, input_len, output_len (tokens); None: sized (workload).
PROFILES = {
    "smoke": {"concurrency": 2, "num_prompts": 8, "input_len": 64, "output_len": 32},
    "steady": {"concurrency": 16, "num_prompts": 256, "input_len": 1024, "output_len": 256},
    "pressure": {"concurrency": None, "num_prompts": None, "input_len": 1024, "output_len": 256},
}
RANGE_RATIO = 0.5  # lengths drawn from [L * ratio, L] (datasets/common.py:56-64 in 0.5.23)
SEED = 42  # the same prompts before and after a change
PRESSURE_DEMAND = 1.2  # pressure: tokens in flight / max_total_num_tokens
PROMPTS_PER_SLOT = 4  # pressure: num_prompts = this x concurrency
MAX_CONCURRENCY = 1024
READY_CHECK_S = 30  # --ready-check-timeout-sec (0.5.10+): the probe already waited for /health
KILL_AFTER_S = 5  # `timeout -k` grace inside a container
TAIL_LINES = 20
MAX_RESULT = 16 << 20  # bytes of a result file read at most
MAX_ERRORS = 3
# What each client module is, where an install has it (relative to its package directory).
PYTHON_CLIENTS = (("sglang.benchmark.serving", "benchmark/serving.py"), ("sglang.bench_serving", "bench_serving.py"))
RUST_CLIENT = ("sglang.benchmark.rust_client", "benchmark/rust_client.py", "srt/rust_extensions")
CLIENT_KINDS = ("auto", "python", "rust")
# The flags the Rust client takes that matter here (its clap definitions live in the .so;
# rust_client.py _DIRECT_FIELDS lists the Python flags it shares).
RUST_FLAGS = frozenset(("--backend", "--host", "--port", "--model", "--tokenizer", "--dataset-name", "--num-prompts",
                        "--random-input-len", "--random-output-len", "--random-range-ratio", "--request-rate",
                        "--max-concurrency", "--seed", "--warmup-requests", "--flush-cache", "--disable-tqdm",
                        "--output-file", "--output-details", "--ready-check-timeout-sec", "--tokenize-prompt"))
_ADD_ARGUMENT = re.compile(r"""add_argument\(\s*["'](--[A-Za-z0-9-]+)["']""")
# The result line's per-request columns (--output-details) and run arguments: not metrics.
DETAILS = frozenset(("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors", "cached_tokens",
                     "cached_tokens_details"))
ARGUMENTS = frozenset(("tag", "backend", "dataset_name", "request_rate", "max_concurrency", "sharegpt_output_len",
                       "random_input_len", "random_output_len", "random_range_ratio"))
# Runs the client module as `python -m MODULE` would, from the install at LOCATION (argv[1]),
# checking `import sglang` resolves to that install's package directory (argv[2]).
RUNNER = r"""
import os, runpy, sys
loc, pkg, mod = sys.argv[1:4]
del sys.argv[1:4]
if loc not in sys.path:
    sys.path.insert(0, loc)
import importlib.util
spec = importlib.util.find_spec("sglang")
got = os.path.dirname(os.path.realpath(spec.origin)) if spec and spec.origin else None
if got != os.path.realpath(pkg):
    sys.stderr.write("fleetctl: sglang resolves to %s here, not to the server's install %s\n" % (got, pkg))
    sys.exit(3)
runpy.run_module(mod, run_name="__main__", alter_sys=True)
"""
# The HF cache locations a server's environment may name: the client finds a Hub id's tokenizer there, offline.
HF_CACHE_VARS = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE")
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def workload(profile, given=None, server_info=None):
    """The run's workload: PROFILES[profile] with the operator's `given` values (concurrency,
    num_prompts, input_len, output_len: positive ints, None for the profile's) in place.
    `pressure` sizes what is not given from server_info["max_total_num_tokens"] (the KV pool,
    tokens): concurrency = ceil(PRESSURE_DEMAND x pool / mean tokens per request), capped at
    MAX_CONCURRENCY, num_prompts = PROMPTS_PER_SLOT x concurrency. Returns {profile, concurrency,
    num_prompts, input_len, output_len, range_ratio, seed, warmup, request_rate ("inf"),
    pool_tokens (None when unknown), demand_tokens (concurrency x mean tokens per request)}.
    Raises ValueError for an unknown profile, a bad value, or a pressure profile the server
    gives no pool size for."""
    if profile not in PROFILES:
        raise ValueError("unknown load profile %r (known: %s)" % (profile, ", ".join(PROFILES)))
    w = dict(PROFILES[profile])
    for k, v in (given or {}).items():
        if k not in w:
            raise ValueError("unknown workload setting %r" % k)
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError("%s must be a positive whole number, not %r" % (k, v))
            w[k] = v
    per_request = (w["input_len"] + w["output_len"]) * (1 + RANGE_RATIO) / 2
    pool = (server_info or {}).get("max_total_num_tokens")
    pool = pool if isinstance(pool, int) and not isinstance(pool, bool) and pool > 0 else None
    if w["concurrency"] is None:
        if pool is None:
            raise ValueError("the pressure profile is sized from /server_info max_total_num_tokens, which this server "
                             "does not give: name the concurrency (--load-concurrency)")
        w["concurrency"] = max(1, min(MAX_CONCURRENCY, int(math.ceil(PRESSURE_DEMAND * pool / per_request))))
    if w["num_prompts"] is None:
        w["num_prompts"] = PROMPTS_PER_SLOT * w["concurrency"]
    w.update(profile=profile, range_ratio=RANGE_RATIO, seed=SEED, warmup=w["concurrency"], request_rate="inf",
             pool_tokens=pool, demand_tokens=int(round(w["concurrency"] * per_request)))
    return w


def flags(source):
    """The long options a client module's argparse declares (`add_argument("--name"`), read from
    its source text: what this client takes, whatever its release (a patched fork included)."""
    return frozenset(_ADD_ARGUMENT.findall(source))


def _version_tuple(v):
    return tuple(int(x) for x in re.findall(r"\d+", v or "")[:3])


def clients(package_dir, kind="auto"):
    """The clients to try in order for the install at `package_dir` (its sglang/ directory):
    [{"module", "path", "rust"}], the Python ones (benchmark/serving.py, else bench_serving.py)
    unless `kind` is "rust", then the Rust one where the install ships it (rust_client.py and a
    _bench*.so) unless `kind` is "python"."""
    found = []
    if kind != "rust":
        for module, rel in PYTHON_CLIENTS:
            path = os.path.join(package_dir, rel)
            if os.path.isfile(path):
                found.append({"module": module, "path": path, "rust": False})
                break
    if kind != "python":
        module, rel, ext = RUST_CLIENT
        path, ext_dir = os.path.join(package_dir, rel), os.path.join(package_dir, ext)
        try:
            so = [n for n in os.listdir(ext_dir) if n.startswith("_bench") and n.endswith(".so")]
        except OSError:
            so = []
        if os.path.isfile(path) and so:
            found.append({"module": module, "path": path, "rust": True})
    return found


def client_argv(python, location, package_dir, client, have, w, host, port, model, tokenizer, output_file,
                version=None, timeout_prefix=()):
    """The argv that runs `client` (clients()) under `python` (the server's interpreter) from the
    install at `location` / `package_dir`, with the workload `w` (workload()) against host:port:
    `python -I -c RUNNER LOCATION PACKAGE_DIR MODULE` and SGLang's own options, only those the
    client declares (`have`: flags()); `--tokenize-prompt` only where the Python client's is not
    broken (0.5.2 sends numpy ints: bench_serving.py:1218-1222; fixed by 0.5.10). No secret is
    ever in it (the API key goes in the environment: client_env). `timeout_prefix`: words put
    first (`timeout -k 5 S` inside a container)."""
    args = ["--backend", "sglang", "--host", host, "--port", str(port), "--model", model, "--tokenizer", tokenizer,
            "--dataset-name", "random-ids", "--num-prompts", str(w["num_prompts"]),
            "--random-input-len", str(w["input_len"]), "--random-output-len", str(w["output_len"]),
            "--random-range-ratio", str(w["range_ratio"]), "--request-rate", "inf",
            "--max-concurrency", str(w["concurrency"]), "--seed", str(w["seed"]),
            "--warmup-requests", str(w["warmup"]), "--flush-cache", "--disable-tqdm", "--output-details",
            "--output-file", output_file]
    if "--ready-check-timeout-sec" in have:
        args += ["--ready-check-timeout-sec", str(READY_CHECK_S)]
    if "--tokenize-prompt" in have and (client["rust"] or _version_tuple(version) >= (0, 5, 10)):
        args.append("--tokenize-prompt")
    missing = [a for a in args if a.startswith("--") and a not in have]
    if missing:
        raise ValueError("%s lacks %s" % (client["module"], ", ".join(missing)))
    return list(timeout_prefix) + [python, "-I", "-c", RUNNER, location, package_dir, client["module"]] + args


def client_env(home, server_env, api_key=None):
    """The client's whole environment (nothing inherited): runas.environment(home) (the system's
    PATH; HOME, TMPDIR and TRITON_CACHE_DIR in the private directory `home`), offline Hub
    (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE), no proxy and NO_PROXY for loopback, the server's HF
    cache variables from `server_env` (its environment, a dict; HF_HOME defaults to the server's
    HOME/.cache/huggingface) and OPENAI_API_KEY when there is a key."""
    env = runas.environment(home, {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
        "NO_PROXY": "127.0.0.1,localhost,::1", "no_proxy": "127.0.0.1,localhost,::1"})
    for k in HF_CACHE_VARS:
        if server_env.get(k):
            env[k] = server_env[k]
    if "HF_HOME" not in env and server_env.get("HOME", "").startswith("/"):
        env["HF_HOME"] = os.path.join(server_env["HOME"], ".cache", "huggingface")
    if api_key:
        env["OPENAI_API_KEY"] = api_key
    return env


def _finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def redact_info(value):
    """A copy of a server_info document with every secret-named key's value (redact.secret_name:
    api_key, admin_api_key, hf_token...) REDACTED and every string redacted as text (redact.text)."""
    if isinstance(value, dict):
        return {k: (redact.REDACTED if isinstance(k, str) and redact.secret_name(k) and v is not None
                    else redact_info(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_info(v) for v in value]
    return redact.text(value) if isinstance(value, str) else value


def parse_result(text, requested):
    """The client's result file `text` (JSONL, one line per run; this run's is the last) for a
    run of `requested` prompts: {"load": {every numeric result key by SGLang's own name
    (completed, request_throughput, output_throughput, median_ttft_ms, p99_ttft_ms, p99_itl_ms,
    p99_e2e_latency_ms, accept_length...; non-finite values None) + requested + failed (not
    completed, plus the streams that ended without text: --output-details' errors and
    generated_texts)},
    "errors": [the first MAX_ERRORS distinct request errors, last line each, redacted],
    "server_info": its copy redacted (redact_info) or None}. Raises ValueError when there is no
    result line or it has no `completed`."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError("the client wrote no result line")
    doc = json.loads(lines[-1])
    if not isinstance(doc, dict) or not isinstance(doc.get("completed"), int):
        raise ValueError("the client's result line has no completed count")
    load = {}
    for k, v in doc.items():
        if k in DETAILS or k in ARGUMENTS or k == "server_info":
            continue
        if _finite(v):
            load[k] = v
        elif v is None or isinstance(v, float):
            load[k] = None
    # a stream that ended with no text (SGLang's in-stream error event: the 0.5.2+ Python clients
    # count it a success, 0.5.23 serving.py:744-805) is a failed request here
    details = [doc.get(k) if isinstance(doc.get(k), list) else [] for k in ("errors", "generated_texts")]
    silent = sum(1 for e, text in zip(*details) if not e and not text)
    load["requested"] = requested
    load["failed"] = max(0, requested - doc["completed"]) + silent
    errors = []
    for e in details[0]:
        last = redact.text(str(e).strip().splitlines()[-1][:300]) if isinstance(e, str) and e.strip() else None
        if last and last not in errors:
            errors.append(last)
    if silent:
        errors.append("%d stream(s) ended without any text (an error event in the stream?)" % silent)
    info = doc.get("server_info")
    return {"load": load, "errors": errors[:MAX_ERRORS], "server_info": redact_info(info) if isinstance(info, dict) else None}


def _environ(pid):
    """The environment of process `pid` as a dict ({} when unreadable); only names are trusted."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            raw = f.read(1 << 20)
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            out[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
    return out


def _get(base, path, api_key, timeout):
    """GET base+path as JSON (never through a proxy; the key as a bearer token): the object, or None."""
    req = urllib.request.Request(base + path, headers={"Authorization": "Bearer " + api_key} if api_key else {})
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            body = json.loads(r.read(smoke.MAX_BODY))
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def server_facts(base, api_key, timeout=30.0):
    """What sizing and the client's options need from the server: {"server_info": /server_info
    (or /get_server_info before 0.5), "model_path", "tokenizer_path"} (/model_info or
    /get_model_info; None when absent)."""
    info = _get(base, "/server_info", api_key, timeout) or _get(base, "/get_server_info", api_key, timeout) or {}
    model = _get(base, "/model_info", api_key, timeout) or _get(base, "/get_model_info", api_key, timeout) or {}
    model_path = model.get("model_path") or info.get("model_path")
    tokenizer = model.get("tokenizer_path") or info.get("tokenizer_path") or model_path
    return {"server_info": info, "model_path": model_path if isinstance(model_path, str) else None,
            "tokenizer_path": tokenizer if isinstance(tokenizer, str) else None}


def _tail(fd):
    """The last TAIL_LINES lines of the log open on `fd` (its last 64 KiB), each redacted."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, 65536, max(0, size - 65536))
    return [redact.text(line) for line in data.decode("utf-8", "replace").splitlines()[-TAIL_LINES:]]


def _read_result(path, uid):
    """The result file's text (runas.read_output: no link, a regular file of the client's uid
    `uid`, at most MAX_RESULT bytes); None when absent or not so. Raises ValueError when larger."""
    data = runas.read_output(path, uid, MAX_RESULT)
    if data is None:
        return None
    return data.decode("utf-8", "replace")


def run_client(argv, env, cwd, deadline_s, acct):
    """Run `argv` as runas.Account `acct` (runas.spawn: its own session and process group,
    no_new_privs; stdin /dev/null, stdout and stderr to a log file this probe creates in `cwd`
    before the client starts), killing the whole group with SIGKILL after `deadline_s` seconds
    and at its end. Returns {returncode, timed_out, duration_s, tail (last lines of its output,
    redacted)}. Raises OSError, subprocess.SubprocessError (it could not start)."""
    t0 = time.monotonic()
    log = os.open(os.path.join(cwd, "client.log"), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        p = runas.spawn(argv, acct, env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
        returncode, timed_out = runas.finish(p, t0 + max(0.1, deadline_s))
        return {"returncode": returncode, "timed_out": timed_out, "duration_s": round(time.monotonic() - t0, 3),
                "tail": _tail(log)}
    finally:
        os.close(log)


def _import_failed(tail):
    return any("ModuleNotFoundError" in line or "ImportError" in line for line in tail)


def _entry(t):
    return {"pid": t["pid"], "host": t["host"], "port": t["port"], "ok": False, "error": None, "not_run": None,
            "client": None, "tried": [], "workload": None, "load": None, "errors": [], "server_info": None,
            "returncode": None, "timed_out": False, "duration_s": None, "tail": [], "ran_as": None}


def _attempt(c, t, sel, w, facts, params, end, acct):
    """One run of client `c` against target `t` until the monotonic deadline `end`, as
    runas.Account `acct`: ({returncode, timed_out, duration_s, tail}, the result file's text or
    None), or (None, why) when its argv cannot be built (a flag it lacks) or it cannot start."""
    python, pkg = sel["python"], sel["package_dir"]
    timeout = shutil.which("timeout") if params.get("in_container") else None
    tmp = runas.private_dir(acct)
    try:
        result_file = os.path.join(tmp, "result.jsonl")
        left = max(1.0, end - time.monotonic())
        try:
            with open(c["path"], "rb") as f:
                have = RUST_FLAGS if c["rust"] else flags(f.read(4 << 20).decode("utf-8", "replace"))
            prefix = (timeout, "-k", str(KILL_AFTER_S), str(int(math.ceil(left)))) if timeout else ()
            argv = client_argv(python, os.path.dirname(pkg), pkg, c, have, w, t["host"], t["port"], facts["model_path"],
                               facts["tokenizer_path"], result_file, sel.get("version"), prefix)
        except (OSError, ValueError) as e:
            return None, str(e)
        try:
            ran = run_client(argv, client_env(tmp, _environ(t["pid"]), params.get("api_key")), tmp, left, acct)
        except (OSError, subprocess.SubprocessError) as e:
            return None, "cannot start as uid %d (%s): %s" % (acct.uid, acct.why, e)
        try:
            text = None if ran["timed_out"] else _read_result(result_file, acct.uid)
        except ValueError as e:
            ran["tail"].append(str(e))
            text = None
        return ran, text
    finally:
        runas.remove(tmp)


def _settle(out, ran, text, w, deadline_s):
    """Fill entry `out` from one client run `ran` and its result file `text` (see main)."""
    out.update(returncode=ran["returncode"], timed_out=ran["timed_out"], duration_s=ran["duration_s"], tail=ran["tail"])
    if ran["timed_out"]:
        out["error"] = "killed at the deadline (%.0f s) with its process group" % deadline_s
        return
    try:
        parsed = parse_result(text or "", w["num_prompts"])
    except ValueError as e:
        out["error"] = "%s (exit %s): %s" % (e, ran["returncode"], " | ".join(ran["tail"][-3:]))
        return
    out.update(load=parsed["load"], errors=parsed["errors"])
    if parsed["server_info"] is not None:
        out["server_info"] = parsed["server_info"]
    failed = parsed["load"]["failed"]
    if failed:
        first = ": " + parsed["errors"][0] if parsed["errors"] else ""
        out["error"] = "%d of %d requests failed%s" % (failed, w["num_prompts"], first)
    else:
        out["ok"] = True


def load_server(t, sel, params, deadline_s):
    """One target `t` ({pid, host, port}: targets.pick) of selector `sel` ({python, package_dir,
    version}): its facts (server_facts), workload, who the client runs as (_runs_as), then the
    clients in order (clients) until one starts, all within `deadline_s` seconds. Returns the
    entry (see main); never raises for the server's or the client's faults."""
    out = _entry(t)
    end = time.monotonic() + deadline_s
    python, pkg = sel.get("python"), sel.get("package_dir")
    if not python or not pkg or os.path.basename(pkg) != "sglang" or not os.path.isdir(pkg):
        out["not_run"] = "no install known for server pid %s (its interpreter %s, package %s)" % (t["pid"], python, pkg)
        return out
    base = "http://%s:%d" % (t["host"] if ":" not in t["host"] else "[%s]" % t["host"], int(t["port"]))
    facts = server_facts(base, params.get("api_key"))
    out["server_info"] = redact_info(facts["server_info"]) if facts["server_info"] else None
    try:
        w = out["workload"] = workload(params.get("profile") or "smoke", params.get("given"), facts["server_info"])
    except ValueError as e:
        out["not_run"] = str(e)
        return out
    if not facts["model_path"]:
        out["not_run"] = "the server names no model_path (/model_info): the client cannot be told what to load"
        return out
    try:
        acct = runas.account([t["pid"]], pkg, params.get("unprivileged_user"))
    except runas.NoAccount as e:
        out["not_run"] = "the client is the install's code, never run as root: %s" % e
        return out
    out["ran_as"] = {"uid": acct.uid, "why": acct.why}
    kind = params.get("client") or "auto"
    for c in clients(pkg, kind):
        ran, text = _attempt(c, t, sel, w, facts, params, end, acct)
        if ran is None:
            out["tried"].append({"client": c["module"], "why": text})
            continue
        if text is None and ran["returncode"] != 0 and not ran["timed_out"] and _import_failed(ran["tail"]):
            out["tried"].append({"client": c["module"], "why": (ran["tail"] or ["exit %s" % ran["returncode"]])[-1]})
            continue  # this client cannot start here: the next one may
        out["client"] = c["module"]
        _settle(out, ran, text, w, deadline_s)
        return out
    if out["tried"]:
        out["not_run"] = "no SGLang benchmark client runs here: " + "; ".join(
            "%s: %s" % (x["client"], x["why"]) for x in out["tried"])
    else:
        out["not_run"] = "no SGLang benchmark client in %s (%s)" % (pkg, {
            "auto": "sglang.benchmark.serving, sglang.bench_serving, or the Rust client sglang.benchmark.rust_client",
            "python": "sglang.benchmark.serving or sglang.bench_serving",
            "rust": "the Rust client sglang.benchmark.rust_client, 0.5.23+"}[kind])
    return out


def scrub(value, secret):
    """`value` (a JSON-able result) with every occurrence of the string `secret` in its strings
    replaced by redact.REDACTED: the API key never leaves the host, whatever quoted it."""
    if not secret:
        return value
    if isinstance(value, dict):
        return {k: scrub(v, secret) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v, secret) for v in value]
    return value.replace(secret, redact.REDACTED) if isinstance(value, str) else value


PD_SKIP = ("a PD %s worker answers a plain /generate with HTTP 400 (no bootstrap room): not loaded itself (%s); "
           "the load runs through a PD router identified on this host")


def main(params):
    """Probe entry point. params: servers (selectors: [{pid, python, port, host, package_dir,
    version}] as the facts probe identified them; targets.live), port, host (the inventory's
    fleetctl_sglang_port/_host: targets.select), profile (PROFILES; "smoke"), given (workload
    values the operator set), client ("auto" | "python" | "rust"), timeout (seconds per client
    run, 300), health_timeout (seconds to wait for a server to listen and answer /health, 60),
    api_key (sent to the targets only, as OPENAI_API_KEY in the client's environment; never
    returned), in_container (this probe runs inside a container: the client also runs under
    `timeout -k`), unprivileged_user (the inventory's: runas.account).
    Returns {"servers": [{pid, host, port, ok, error, not_run, client, tried: [{client, why}],
    workload, load: {SGLang's result keys, requested, failed} or None, errors, server_info
    (redacted), returncode, timed_out, duration_s (seconds), tail, ran_as: {uid, why} the account
    the client ran as}], "refused": [{pid, host,
    port, reason}] (nothing was sent to them), "skipped": [{pid, host, port, node_rank, reason}]
    (non-zero-rank nodes of a multi-node server and PD workers, smoke.pd_plan: nothing was sent to them)}."""
    smoke.API_KEY = params.get("api_key")
    selectors = params.get("servers") or []
    health_timeout = float(params.get("health_timeout", 60))
    picked, waited = smoke.choose(selectors, params.get("port"), params.get("host"), health_timeout,
                                  params.get("server_user"))
    servers, skipped = [], []
    plan = smoke.pd_plan(picked["targets"], listeners.local_addresses())
    for t in picked["targets"]:
        part = plan.get(t["pid"]) or {}
        if part.get("role") in ("prefill", "decode"):  # a plain /generate gets HTTP 400 there (smoke.py)
            skipped.append({"pid": t["pid"], "host": t["host"], "port": t["port"], "node_rank": t.get("node_rank") or 0,
                            "reason": PD_SKIP % (part["role"], part["via"])})
            continue
        if (t.get("node_rank") or 0) >= 1:  # a non-zero-rank node's port serves /health only (targets.py)
            skipped.append({"pid": t["pid"], "host": t["host"], "port": t["port"], "node_rank": t["node_rank"],
                            "reason": "node rank %d of a multi-node server: its port serves only /health; the "
                                      "load runs against rank 0" % t["node_rank"]})
            continue
        sel = next((s for s in selectors if s.get("pid") == t["pid"]), None) or \
            next((s for s in selectors if int(s.get("port") or 0) == t["port"]), {})
        healthy, _, why = smoke.wait_healthy(
            "http://%s:%d" % (t["host"] if ":" not in t["host"] else "[%s]" % t["host"], t["port"]),
            max(1.0, health_timeout - waited),
            exited=smoke.watch(selectors, params.get("port"), params.get("host"), params.get("server_user"), t))
        if not healthy:
            servers.append(dict(_entry(t), error=why))
            continue
        servers.append(load_server(t, sel, params, float(params.get("timeout", 300))))
    for p in picked["pending"]:
        servers.append(dict(_entry(p), error=smoke.pending_error(p, health_timeout, waited)))
    for s in servers:
        s["error"], s["not_run"] = redact.text(s["error"]), redact.text(s["not_run"])
    return scrub({"servers": servers, "refused": picked["refused"], "skipped": skipped}, params.get("api_key"))
