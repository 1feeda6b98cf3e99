"""fleetctl SGLang STAND-IN server for the lab. This is not SGLang.

A lab host has no GPU and no model, so this stand-in answers SGLang's HTTP API with the same
request and response fields, backed by engine.py beside this file (a tiny decoder-only
transformer in torch over a paged KV pool in SGLang's layout, greedy speculative decoding with
SGLang's target-verify hook: see its docstring): tokens are deterministic and latency is real.
With speculation, meta_info carries SGLang's speculative metrics (spec_verify_ct,
spec_accept_length, ...: out_dict), and with return_logprob its logprob keys. Every answer
that describes the server says `"stand_in": true`, and every log line starts with "fleetctl
stand-in".

Shapes follow the installed SGLang releases (0.5.23, cross-checked with 0.5.10):
- routes `/health`, `/health_generate` (503 while starting), `/generate`, `/server_info`,
  `/get_server_info`, `/model_info`, `/get_model_info`, `/v1/completions`, `/v1/models`,
  `/flush_cache`: sglang/srt/entrypoints/http_server.py;
- the `/generate` request (`text` or `input_ids`, `sampling_params`, `rid`, `stream`, and the keys
  SGLang's benchmark clients send at their "off" values, OFF_KEYS): `GenerateReqInput` in
  sglang/srt/managers/io_struct.py;
- `stream: true`: `text/event-stream`, one `data: {json}` event per token with the cumulative
  `text`, `output_ids` and `meta_info` (`finish_reason` null until the last), then
  `data: [DONE]`; an error once the stream has begun is an `{"error": {...}}` event before
  `[DONE]` (0.5.23 http_server.py `stream_results`, tokenizer_manager.py's non-incremental
  streaming);
- `/server_info` also carries the scheduler's `max_total_num_tokens` and `max_req_input_len`
  (scheduler.py `get_init_info`) and one `internal_states` entry (the benchmark clients of
  0.4.6 and 0.5.2 read `internal_states[0]`);
- sampling parameter names and defaults (max_new_tokens=128, temperature=1.0, ...):
  `SamplingParams` in sglang/srt/sampling/sampling_params.py;
- the response `{"text", "output_ids", "meta_info": {...}}` and the meta_info keys: the
  output handler of `TokenizerManager` in sglang/srt/managers/tokenizer_manager.py;
  finish reasons `{"type": "length", "length": N}` / `{"type": "stop", "matched": ID}`:
  `FINISH_LENGTH` / `FINISH_MATCHED_TOKEN` in sglang/srt/managers/schedule_batch.py;
  `e2e_latency` is seconds from request arrival to finish (req_time_stats.py);
- `/server_info` keys: `ServerArgs` fields (0.5.10 server_args.py) + internal_states, version;
- `/v1/completions`: `CompletionRequest` / `CompletionResponse` in
  sglang/srt/entrypoints/openai/protocol.py.

Misbehaviour for tests comes from a JSON behaviour file read at startup (`--behavior`,
default `behavior.json` next to this script; a missing file means behave):
  {"unhealthy_for_s": S}   /health answers 503 for S seconds after start ("still starting")
  {"never_healthy": true}  /health answers 503 forever
  {"token_shift": K}       every greedy pick is shifted by K (mod vocab): different tokens
  {"slowdown": F}          every decode step takes F times as long (measured, then slept)
  {"delay_ms": M}          every decode step takes M ms longer (a fixed slowdown, whatever the machine)
  {"truncate_tokens": N}   generation stops after N tokens with a "stop" finish reason
  {"contention_ms": M}     every decode step takes M ms x (requests in flight - 1) longer: a
                           slowdown only concurrent requests see (a lone one, the smoke, does not)
  {"fail_every": N}        every Nth streamed /generate request since the behaviour took effect
                           answers HTTP 500 before any token (non-streamed ones, the smoke's, are
                           not counted), which SGLang's benchmark clients count as failed
  {"hot_expert": {"layer": L, "expert": E}}  (the MoE model) layer L's router puts expert E in
                           every token's top-2: E gets half of layer L's expert assignments
                           (balanced: 1/8), and its rank (E // (8 / ep_size)) the most tokens
  {"slow_attention_ms": M} every attention kernel region (decode, extend, verify) sleeps M ms more
                           inside, so a profile shows the attention kernels' share grow
SIGHUP rereads the behaviour file (the counters of fail_every start again); a file that does not
parse keeps the behaviour there was, and the log says why.

SGLang's diagnostic instruments (instruments.py; engine.py KERNELS), for `fleetctl diagnose`. The
release spoken is $FLEETCTL_STANDIN_SGLANG, else the sglang installed beside the interpreter, else
0.5.23 (releases modelled: 0.4.6.post5, 0.5.2, 0.5.10, 0.5.23; all four have all five routes).
Every route below takes GET or POST (0.5.23 http_server.py:1221-1297), and answers 200 text/plain:
- `/start_profile` [JSON body: ProfileReqInput; fields a release lacks are ignored: 0.4.6.post5
  output_dir, num_steps, activities, with_stack, record_shapes; 0.5.2 + start_step,
  profile_by_stage; 0.5.10 + profile_prefix (merge_profiles, profile_stages refused); 0.5.23 +
  profile_id] -> "Start profiling.\n". Runs the real torch.profiler (CPU activity: activities
  CPU and/or GPU, default both; MEM, CUDA_PROFILER, RPD refused 400) over the next forward passes
  (one pass: a prefill, a decode step, or a speculative verify with its drafts). With num_steps it
  stops itself at the start of the pass after num_steps passes (num_steps - 1 passes profiled
  before 0.5.23), so an idle server writes nothing until traffic comes; 0.4.6.post5 answers the
  start only then. Without num_steps it runs until /stop_profile.
  The trace: `{output_dir}/{profile_id}-TP-{r}.trace.json.gz`, one per TP rank r (the same trace),
  profile_id str(time.time()) (0.5.23: the request's if given), output_dir the request's, else
  $SGLANG_TORCH_PROFILER_DIR, else /tmp, made if missing (0.5.2+; 0.5.10+ expands ~); 0.5.10+:
  `{profile_prefix}-` first and `-EP-{r // (tp/ep)}` after TP with --ep-size > 1; profile_by_stage
  (with num_steps) writes one trace per stage, suffix `-EXTEND`/`-DECODE` (0.5.10+) or `-1`/`-2`
  (0.5.2 on Python 3.11+: str() of an IntEnum). with_stack defaults true, record_shapes false
  (0.5.23: true). A second start while one runs, or a stop with none running: HTTP 500 "Internal
  Server Error" (SGLang's tokenizer raises RuntimeError), the reason in the log.
  The trace's kernel regions are record_function names from SGLang's source (engine.py KERNELS):
  decode attention `_fwd_grouped_kernel_stage1` + `_fwd_kernel_stage2`; prefill and verify
  attention `_fwd_kernel`; MoE routing `topk_softmax`, `moe_align_block_size`; MoE experts
  `fused_moe_kernel` (twice a layer), `silu_and_mul`; all-reduce `sglang::outplace_all_reduce`
  (--tp-size > 1 only); sampling `top_k_top_p_sampling_from_probs` (temperature > 0; greedy is
  aten::argmax); verify acceptance `verify_tree_greedy`. Regions never nest; the aten ops inside one
  are its CPU work; dense GEMMs are the aten::linear ops outside every region. The first start in a
  process takes seconds (torch imports its compiler stack then).
- `/stop_profile` -> "Stop profiling. This will take some time.\n" once the trace is written.
- `/start_expert_distribution_record` -> "Start recording the expert distribution.\n" (clears
  the record), `/stop_expert_distribution_record` -> "Stop recording the expert distribution.\n",
  `/dump_expert_distribution_record` -> "Dump expert distribution record.\n" (writes, then clears;
  recording goes on if on). Needs `--expert-distribution-recorder-mode` (stat; per_pass from
  0.5.2), which needs the MoE model (`--model-path fleetctl-standin/tiny-moe`: 2 layers of 8
  experts, top-2; else the server refuses to start, as SGLang asserts). Counts: per forward pass,
  per layer, per expert, the tokens routed there (each token counts TOPK times). The dump goes to
  $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else /tmp (made if missing), with torch.save (loads
  with torch.load(weights_only=True)):
  stat: rank 0 writes `expert_distribution_recorder_{time.time()}.pt` = {"rank": 0,
  "logical_count": int32 [buffer passes (--expert-distribution-recorder-buffer-size, default 1000,
  a ring; -1: every pass), 2, 8], summed over the TP ranks (each sees every token: x tp_size),
  "average_utilization_rate_over_window": None (absent in 0.4.6.post5)};
  per_pass: each TP rank r writes `expert_distribution_recorder_{time.time()}_{r}.pt` =
  {"records": [{"forward_pass_id", "rank", "gatherer_key": "primary", "global_physical_count":
  int32 [2, 8]}], "last_physical_to_logical_map": int64 [2, 8] (identity rows)}.
  Expert e lives on EP rank e // (8 / ep_size) (SGLang's balancedness: mean over max of the
  per-rank sums, eplb/expert_distribution.py compute_utilization_rate).
- Faithful dangers: the recorder routes without a recorder mode, or a trace/dump directory the
  server cannot write (or, before 0.5.2, a missing trace directory), raise in SGLang's scheduler,
  and the whole server exits (scheduler_died: the request gets no answer, the process exits 1).
`/server_info` also says ep_size, expert_distribution_recorder_mode,
expert_distribution_recorder_buffer_size, decode_log_interval (40), and internal_states[0]
carries memory_usage (0.5.2+: weight, kvcache in GB, token_capacity, graph), load (0.5.2 only:
KV slots held plus waiting prompt tokens) and, with speculative decoding, avg_spec_accept_length:
accepted tokens (drafts taken + 1) per verify pass, folded in every 40 decode passes as SGLang's
decode log does (absent before the first fold).
A PD worker (`--disaggregation-mode prefill|decode`, `--disaggregation-bootstrap-port N`, default
8998: 0.5.10 server_args.py:695-697,5743-5760; 0.5.23 arg_groups/fields/disagg.py:55-58,81-83)
refuses a /generate without `bootstrap_room` as SGLang's scheduler does (0.5.10
managers/scheduler.py:1780-1788, 0.5.23 managers/scheduler.py:3048-3056: "Invalid request:
Disaggregated request received without bootstrap room id. req.rid=...", HTTPStatus.BAD_REQUEST),
answered as http_server.py's `_create_error_response` does (0.5.10 http_server.py:1723-1726:
HTTP 400 {"error": {"message": ...}}); a streamed one gets that as a `data: {"error": ...}` event,
then `[DONE]` (stream_results, 0.5.10 http_server.py:665-676). /health_generate still decodes (SGLang
fills a fake bootstrap room there: 0.5.10 http_server.py:513-514, 0.5.23 http_server.py:764-765).
/server_info says `disaggregation_mode` and `disaggregation_bootstrap_port`. The PD router that
fills the rooms is sglang_router/launch_router.py beside this file.
`--api-key KEY` protects every route but /health*, /ready* and /metrics* as SGLang's does
(sglang/srt/utils/auth.py `decide_request_auth`, 0.5.23): `Authorization: Bearer KEY`, else 401.

Multi-node layouts take ServerArgs' names (--node-rank, --nnodes, --dist-init-addr, --dp-size,
--enable-dp-attention, --pp-size, --base-gpu-id, --gpu-id-step), reported in /server_info. With
`--node-rank 1` and above the stand-in is a non-zero-rank node: like SGLang's dummy health
server there (`launch_dummy_health_check_server`: 0.5.23 sglang/srt/utils/common.py, started by
entrypoints/engine.py for node_rank >= 1, "non-zero rank nodes do not need to run tokenizer or
detokenizer"), its port answers GET /health, /health_generate and /ping with an empty 200 (503
here while the model loads, where SGLang would not listen yet), another method there with 405
and every other path with FastAPI's 404 {"detail": "Not Found"}, with no API key check.

The tokenizer SGLang's Python benchmark clients load (`--tokenizer`, or /model_info's
`tokenizer_path`) is `tokenizer/` beside this file: byte-level, id i = byte i, 256 `<eos>`,
257..511 reserved special tokens, the same as engine.py's encode/decode.

Stdlib + torch only; never imports fleetctl (it is copied with engine.py onto lab hosts).
Usage: python server.py --host 127.0.0.1 --port 30000 --model-path fleetctl-standin/tiny
"""

import argparse
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

if __package__:  # imported as fleetctl.lab.standin.server
    from .engine import (CONTEXT, DECODE_LOG_INTERVAL, EXPERTS, HEAD_DIM, HEADS, KV_HEADS, LAYERS, MOE_MODEL,
                         BadRequest, Engine, decode,
                         encode, load_verify_hook)
    from .instruments import ExpertRecorder, Profiler, Refused, SchedulerCrash, recorder_modes, release_key
else:  # the script (python server.py, the sglang_router launcher's workers): engine.py is beside it, on sys.path
    from engine import (CONTEXT, DECODE_LOG_INTERVAL, EXPERTS, HEAD_DIM, HEADS, KV_HEADS, LAYERS, MOE_MODEL,
                        BadRequest, Engine, decode,
                        encode, load_verify_hook)
    from instruments import ExpertRecorder, Profiler, Refused, SchedulerCrash, recorder_modes, release_key

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.path.join(HERE, "tokenizer")
log = logging.getLogger("fleetctl-standin")

BEHAVIOR_KEYS = {"unhealthy_for_s", "never_healthy", "token_shift", "slowdown", "delay_ms", "truncate_tokens",
                 "contention_ms", "fail_every", "hot_expert", "slow_attention_ms"}
# the instruments' routes (GET or POST) and their 200 answers (0.5.23 http_server.py:1221-1297)
INSTRUMENT_ROUTES = {
    "/start_profile": "Start profiling.\n",
    "/stop_profile": "Stop profiling. This will take some time.\n",
    "/start_expert_distribution_record": "Start recording the expert distribution.\n",
    "/stop_expert_distribution_record": "Stop recording the expert distribution.\n",
    "/dump_expert_distribution_record": "Dump expert distribution record.\n",
}
NO_EXPERT_METADATA = ("ExpertLocationMetadata is required for expert distribution recording. One possible reason "
                      "is that you are using a model that does not support expert distribution recording.")
MAX_TOTAL_TOKENS = 16384  # the KV pool size (slots) unless --max-total-tokens; at least CONTEXT + 16
# The subsets of GenerateReqInput / SamplingParams / CompletionRequest fields implemented here;
# any other field is refused with 400 instead of being silently ignored.
GENERATE_KEYS = {"text", "input_ids", "sampling_params", "rid", "stream"}
# GenerateReqInput's PD fields (0.5.10 io_struct.py:191-193, 0.5.23 io_struct.py:291-293): a PD
# router fills them; a PD worker refuses a request without bootstrap_room (pd_refusal)
PD_KEYS = {"bootstrap_host", "bootstrap_port", "bootstrap_room"}
# GenerateReqInput fields the benchmark clients always send, accepted at these values only
# (0.5.23 benchmark/serving.py async_request_sglang_generate; 0.4.6-0.5.10 bench_serving.py)
OFF_KEYS = {"lora_path": None, "return_routed_experts": False, "token_ids_logprob": None}
# GenerateReqInput's logprob fields, implemented (Engine._logprobs): their types and defaults
LOGPROB_KEYS = {"return_logprob": (bool, False), "logprob_start_len": (int, -1), "top_logprobs_num": (int, 0)}
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
           "waiting requests, the operation will not be performed.)\n")  # http_server.py flush_cache
SAMPLING_KEYS = {"max_new_tokens", "min_new_tokens", "temperature", "ignore_eos",
                 "stop_token_ids", "sampling_seed", "n"}
COMPLETION_KEYS = {"model", "prompt", "max_tokens", "temperature", "n", "seed", "stream",
                   "ignore_eos", "stop_token_ids", "min_tokens"}



class Injected(RuntimeError):
    """A failure the behaviour asked for (fail_every): HTTP 500."""


def load_behavior(path):
    """Read the behaviour file (JSON object, keys in BEHAVIOR_KEYS); {} if the file is missing.

    Raises ValueError on unknown keys or a non-object, so a typo never means "behave".
    """
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        b = json.load(f)
    if not isinstance(b, dict) or set(b) - BEHAVIOR_KEYS:
        raise ValueError("behaviour file %s: expected an object with keys from %s, got %r"
                         % (path, sorted(BEHAVIOR_KEYS), b))
    hot = b.get("hot_expert")
    if hot is not None and not (isinstance(hot, dict) and set(hot) == {"layer", "expert"}
                                and all(type(v) is int for v in hot.values())
                                and 0 <= hot["layer"] < LAYERS and 0 <= hot["expert"] < EXPERTS):
        raise ValueError("behaviour file %s: hot_expert must be {\"layer\": 0..%d, \"expert\": 0..%d}, got %r"
                         % (path, LAYERS - 1, EXPERTS - 1, hot))
    return b



class StandIn:
    """Server state: configuration, behaviour, the engine once loaded, startup time, counters."""

    def __init__(self, args, behavior):
        self.args, self.behavior = args, behavior
        self.started, self.created = time.monotonic(), time.time()
        self.engine = None
        self.counters = {"generate": 0, "flush_cache": 0}  # requests since start, in /server_info
        self.streamed = 0  # streamed /generate requests since the behaviour took effect (fail_every)
        self.lock = threading.Lock()

    def reload(self):
        """SIGHUP: read the behaviour file again and use it from now on (fail_every counts anew);
        a file that does not parse leaves the behaviour as it was (logged)."""
        try:
            behavior = load_behavior(self.args.behavior)
        except (OSError, ValueError) as e:
            log.error("fleetctl stand-in: behaviour not reloaded, keeping %s: %s", self.behavior, e)
            return
        with self.lock:
            self.behavior, self.streamed = behavior, 0
        if self.engine is not None:
            self.engine.behavior = behavior
        log.info("fleetctl stand-in: behaviour reloaded: %s", json.dumps(behavior, sort_keys=True))

    def count(self, what, streamed=False):
        """Count one request of route `what`; a streamed /generate is the fail_every one when its
        number is a multiple of N: raises Injected then."""
        with self.lock:
            self.counters[what] += 1
            if not streamed:
                return
            self.streamed += 1
            n, every = self.streamed, self.behavior.get("fail_every")
        if every and n % int(every) == 0:
            raise Injected("fleetctl stand-in: fail_every %d: streamed request %d fails" % (every, n))

    def load(self):
        """Build the model and warm it up (runs in a thread while /health answers 503)."""
        try:
            a = self.args
            verify, said = load_verify_hook(a.attention_backend)
            draft = (a.speculative_num_draft_tokens or 4) if a.speculative_algorithm else None
            engine = Engine(a.random_seed, self.behavior, a.max_total_tokens, draft, verify, a.speculative_algorithm,
                            moe=a.model_path == MOE_MODEL, tp_size=a.tp_size)
            engine.profiler = Profiler(a.release, a.tp_size, a.ep_size)
            engine.recorder = ExpertRecorder(a.release, a.expert_distribution_recorder_mode,
                                             a.expert_distribution_recorder_buffer_size, LAYERS, EXPERTS,
                                             a.tp_size, a.ep_size)
            engine.crash_types, engine.on_crash = (SchedulerCrash,), scheduler_died
            engine.generate([0], {"max_new_tokens": 2, "temperature": 0})
            self.engine = engine
            log.info("fleetctl stand-in: model ready (tiny %d-layer transformer, %d query heads, %d KV heads "
                     "of %d, seed %d, %s, behaviour %s)", LAYERS, HEADS, KV_HEADS, HEAD_DIM, a.random_seed,
                     "speculative %s, %d draft tokens; %s" % (a.speculative_algorithm, draft, said)
                     if draft else "no speculative decoding", self.behavior)
        except Exception:  # /health then answers 503 forever; the log says why
            log.exception("fleetctl stand-in: model load failed")

    def healthy(self):
        """True when /health answers 200: loaded, not told to stay unhealthy."""
        b = self.behavior
        return (self.engine is not None and not b.get("never_healthy")
                and time.monotonic() - self.started >= float(b.get("unhealthy_for_s", 0)))

    def run(self, prompt, sp, rid, on_chunk=None, logprobs=None):
        """One finished generate result, shaped like TokenizerManager's out dict. on_chunk, if
        given, gets each unfinished one (cumulative text, output_ids, meta_info, finish_reason
        None) as it is decoded: a stream's events. logprobs: parse's, None for none."""
        t0 = time.perf_counter()
        on_token = None if on_chunk is None else lambda ids: on_chunk(out_dict(rid, prompt, ids, None))
        ids, finish, info = self.engine.generate(prompt, sp, on_token, logprobs)
        out = out_dict(rid, prompt, ids, finish, info)
        out["meta_info"]["e2e_latency"] = time.perf_counter() - t0
        log.info("fleetctl stand-in: generate rid=%s prompt_tokens=%d completion_tokens=%d "
                 "e2e_latency=%.4fs", rid, len(prompt), len(ids), out["meta_info"]["e2e_latency"])
        return out

    def parse(self, req):
        """Check a GenerateReqInput-shaped dict -> (prompts, sampling params, rids, batch, logprobs:
        None, or {"top": top_logprobs_num, "start": logprob_start_len} with return_logprob).
        Raises BadRequest for what the stand-in does not implement (a key, or an OFF_KEYS key
        at another value) or an invalid request."""
        unknown = set(req) - GENERATE_KEYS - PD_KEYS - set(OFF_KEYS) - set(LOGPROB_KEYS)
        if unknown:
            raise BadRequest("fleetctl stand-in does not implement %s" % sorted(unknown))
        on = sorted(k for k in set(req) & set(OFF_KEYS)
                    if not (req[k] is None or (type(req[k]) is type(OFF_KEYS[k]) and req[k] == OFF_KEYS[k])))
        if on:
            raise BadRequest("fleetctl stand-in implements %s only at %s"
                             % (on, {k: OFF_KEYS[k] for k in on}))
        for k, (kind, default) in LOGPROB_KEYS.items():
            if req.get(k) is not None and (type(req[k]) is not kind or (kind is int and req[k] < -1)):
                raise BadRequest("%s must be %s, got %r" % (k, kind.__name__, req[k]))
        logprobs = ({"top": req.get("top_logprobs_num") or 0, "start": req.get("logprob_start_len", -1)}
                    if req.get("return_logprob") else None)
        if (req.get("text") is None) == (req.get("input_ids") is None):
            raise BadRequest("Either text or input_ids should be provided.")
        sp = req.get("sampling_params") or {}
        if not isinstance(sp, dict) or set(sp) - SAMPLING_KEYS or sp.get("n", 1) != 1:
            raise BadRequest("fleetctl stand-in implements sampling_params %s (n=1 only), got %r"
                             % (sorted(SAMPLING_KEYS), sp))
        if req.get("text") is not None:
            batch = isinstance(req["text"], list)
            prompts = [encode(t) for t in (req["text"] if batch else [req["text"]])]
        else:
            ids = req["input_ids"]
            batch = bool(ids) and isinstance(ids[0], list)
            prompts = ids if batch else [ids]
        rid = req.get("rid")
        if isinstance(rid, list):
            rids = rid
        elif batch:
            rids = [uuid.uuid4().hex for _ in prompts]
        else:
            rids = [rid or uuid.uuid4().hex]
        if req.get("stream") and batch:
            raise BadRequest("fleetctl stand-in does not implement stream=true for a batch")
        return prompts, sp, rids, batch, logprobs

    def generate(self, req):
        """POST /generate without stream: a GenerateReqInput-shaped dict -> one result or a list
        (batch). Raises BadRequest (HTTP 400)."""
        prompts, sp, rids, batch, logprobs = self.parse(req)
        self.count("generate")
        outs = [self.run(p, sp, r, logprobs=logprobs) for p, r in zip(prompts, rids)]
        return outs if batch else outs[0]

    def flush_cache(self, timeout_s):
        """POST/GET /flush_cache: there is no cache to flush, but like SGLang it happens only when
        no request is running, waiting up to timeout_s for that. (status, text)."""
        self.count("flush_cache")
        end = time.monotonic() + timeout_s
        while self.engine.inflight and time.monotonic() < end:
            time.sleep(0.01)
        return (400, "Flush cache failed.\n") if self.engine.inflight else (200, FLUSHED)

    def models(self):
        """GET /v1/models: one ModelCard (sglang/srt/entrypoints/openai/protocol.py)."""
        a = self.args
        return {"object": "list", "data": [{"id": a.model_path, "object": "model", "created": int(self.created),
                                            "owned_by": "sglang", "root": a.model_path, "parent": None,
                                            "max_model_len": CONTEXT}]}

    def completions(self, req):
        """POST /v1/completions: CompletionRequest subset -> CompletionResponse dict."""
        unknown = set(req) - COMPLETION_KEYS
        if unknown or req.get("stream") or req.get("n", 1) != 1 or "prompt" not in req:
            raise BadRequest("fleetctl stand-in implements %s (n=1, no stream, prompt required), "
                             "got %s" % (sorted(COMPLETION_KEYS), sorted(req)))
        prompt = req["prompt"]
        sp = {"max_new_tokens": req.get("max_tokens", 16), "temperature": req.get("temperature", 1.0),
              "ignore_eos": req.get("ignore_eos", False), "stop_token_ids": req.get("stop_token_ids"),
              "sampling_seed": req.get("seed"), "min_new_tokens": req.get("min_tokens", 0)}
        out = self.run(encode(prompt) if isinstance(prompt, str) else prompt, sp, uuid.uuid4().hex)
        meta = out["meta_info"]
        finish = meta["finish_reason"]
        return {
            "id": meta["id"], "object": "text_completion", "created": int(time.time()),
            "model": req.get("model", "default"),
            "choices": [{"index": 0, "text": out["text"], "logprobs": None,
                         "finish_reason": finish["type"], "matched_stop": finish.get("matched")}],
            "usage": {"prompt_tokens": meta["prompt_tokens"],
                      "completion_tokens": meta["completion_tokens"],
                      "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"],
                      "prompt_tokens_details": None, "reasoning_tokens": 0},
            "metadata": {"weight_version": meta["weight_version"]},
        }

    def model_info(self):
        """GET /model_info (and the deprecated /get_model_info)."""
        a = self.args
        return {"model_path": a.model_path, "tokenizer_path": TOKENIZER_DIR, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": "fleetctl_standin", "architectures": [
                    "FleetctlStandInMoeForCausalLM" if a.model_path == MOE_MODEL else "FleetctlStandInForCausalLM"],
                "stand_in": True}

    def internal_state(self):
        """/server_info's internal_states[0], the scheduler's get_internal_state by release:
        last_gen_throughput; memory_usage from 0.5.2 (memory_usage()); load in 0.5.2 only
        (Engine.load); avg_spec_accept_length with speculative decoding once a decode-log interval
        has folded verify passes in (Engine.avg_spec_accept_length; 0.4.6.post5
        managers/scheduler.py:1893-1896, 0.5.23 scheduler_components/internal_state.py:117-125)."""
        a, engine = self.args, self.engine
        st = {"last_gen_throughput": 0.0, "effective_max_running_requests_per_dp": 1,
              "num_running_reqs": engine.inflight if engine else 0}
        if a.release >= (0, 5, 2):
            st["memory_usage"] = memory_usage(a, engine)
        if (0, 5, 2) <= a.release < (0, 5, 10):
            st["load"] = engine.load() if engine else 0
        accept = engine.avg_spec_accept_length() if engine and a.speculative_algorithm else None
        if accept is not None:
            st["avg_spec_accept_length"] = accept
        return st

    def instrument(self, path, body):
        """One of INSTRUMENT_ROUTES with its JSON body (None: none) -> (status, text). The work runs
        on the scheduler thread (Engine.on_scheduler); a SchedulerCrash there ends the server
        (scheduler_died). An instrument that answers failure (SGLang's tokenizer raises
        RuntimeError on it) -> 500 "Internal Server Error", the message in the log. Raises
        Refused for a body it does not take."""
        engine = self.engine
        prof, rec = engine.profiler, engine.recorder
        if path == "/start_profile":
            req = prof.parse(body)
            result, waiter = engine.on_scheduler(lambda: (prof.start(req, engine.forward_ct), prof.waiter))
            if result is None:  # 0.4.6.post5 with num_steps: the answer is the stop's
                waiter.wait()
                result = (True, "Succeeded.")
        elif path == "/stop_profile":
            result = engine.on_scheduler(prof.stop)
        else:
            engine.on_scheduler({"/start_expert_distribution_record": rec.start,
                                 "/stop_expert_distribution_record": rec.stop,
                                 "/dump_expert_distribution_record": rec.dump}[path])
            result = (True, "")
        if not result[0]:
            log.error("fleetctl stand-in: %s: RuntimeError: %s", path, result[1])
            return 500, "Internal Server Error"
        return 200, INSTRUMENT_ROUTES[path]

    def server_info(self):
        """GET /server_info (and the deprecated /get_server_info): ServerArgs-named fields."""
        a = self.args
        pool = a.max_total_tokens
        engine = self.engine
        return {"model_path": a.model_path, "tokenizer_path": TOKENIZER_DIR, "host": a.host,
                "port": a.port, "tp_size": a.tp_size, "context_length": CONTEXT, **layout(a),
                "random_seed": a.random_seed, "skip_tokenizer_init": False, "page_size": 1,
                "kv_cache_dtype": "auto", "attention_backend": a.attention_backend,
                "speculative_algorithm": a.speculative_algorithm,
                "speculative_num_draft_tokens": (a.speculative_num_draft_tokens or 4) if a.speculative_algorithm else None,
                "speculative_eagle_topk": (a.speculative_eagle_topk or 1) if a.speculative_algorithm else None,
                "speculative_num_steps": a.speculative_num_steps if a.speculative_algorithm else None,
                "max_running_requests": None, "max_total_tokens": pool,
                "max_total_num_tokens": pool, "max_req_input_len": min(CONTEXT, pool) - 1,
                "weight_version": "default", "version": sglang_version(),
                "ep_size": a.ep_size, "expert_distribution_recorder_mode": a.expert_distribution_recorder_mode,
                "expert_distribution_recorder_buffer_size": recorder_buffer_size(a),
                "decode_log_interval": DECODE_LOG_INTERVAL,
                "internal_states": [self.internal_state()],
                "disaggregation_mode": a.disaggregation_mode,
                "disaggregation_bootstrap_port": a.disaggregation_bootstrap_port,
                "stand_in": True, "stand_in_behavior": self.behavior, "stand_in_counters": dict(self.counters)}


def memory_usage(a, engine):
    """internal_states' memory_usage (GB, the stand-in's CPU tensors): 0.5.2 managers/scheduler.py:
    2246-2258 and 0.5.10 scheduler.py:3071-3078 {weight, kvcache, token_capacity, graph}; 0.5.23
    scheduler_components/memory_usage.py:29-41 adds startup_available and token_capacity_swa and
    makes graph a dict per phase."""
    gb = 2.0 ** 30
    weight = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / gb if engine else 0.0
    kv = 2 * LAYERS * (a.max_total_tokens + 1) * KV_HEADS * HEAD_DIM * 4 / gb
    if a.release >= (0, 5, 23):
        return {"weight": round(weight, 3), "kvcache": round(kv, 3), "startup_available": 0.0,
                "token_capacity": int(a.max_total_tokens), "token_capacity_swa": None, "graph": {}}
    return {"weight": round(weight, 2), "kvcache": round(kv, 2), "token_capacity": int(a.max_total_tokens),
            "graph": 0.0}


def recorder_buffer_size(a):
    """ServerArgs.expert_distribution_recorder_buffer_size as resolved: eplb_rebalance_num_iterations
    (1000) when unset, from 0.5.2 (0.5.2 server_args.py:699-703); 0.4.6.post5 sets 1000 only with a
    recorder mode (server_args.py:368-375)."""
    if a.expert_distribution_recorder_buffer_size is not None:
        return a.expert_distribution_recorder_buffer_size
    return 1000 if a.release >= (0, 5, 2) or a.expert_distribution_recorder_mode else None


def scheduler_died(e):
    """What SGLang does when its scheduler raises: log the exception, and the whole server exits
    (run_scheduler_process's handler SIGQUITs the launcher, which kills the process tree: 0.5.23
    managers/scheduler.py, entrypoints/engine.py). The client's request gets no answer."""
    log.error("fleetctl stand-in: Scheduler hit an exception: %s: %s", type(e).__name__, e)
    logging.shutdown()
    os._exit(1)


def layout(a):
    """The multi-node and parallel ServerArgs fields of /server_info, as given on the command line."""
    return {"dp_size": a.dp_size, "pp_size": a.pp_size, "enable_dp_attention": a.enable_dp_attention,
            "nnodes": a.nnodes, "node_rank": a.node_rank, "dist_init_addr": a.dist_init_addr,
            "base_gpu_id": a.base_gpu_id, "gpu_id_step": a.gpu_id_step}


def out_dict(rid, prompt, ids, finish, info=None):
    """A generate result as TokenizerManager shapes it: {text, output_ids, meta_info}; ids and
    text cumulative, finish_reason None while unfinished (no e2e_latency then). `info`
    (Engine.generate's): the logprob keys, and the speculative metrics as SGLang adds them only
    for a request that was verified at least once (0.5.23 tokenizer_manager.py
    _calculate_spec_decoding_metrics, :3138-3172: spec_accept_rate, spec_accept_length =
    completion_tokens / spec_verify_ct, spec_num_correct_drafts, spec_num_proposed_drafts,
    spec_verify_ct)."""
    meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt), "weight_version": "default",
            "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": len(ids), "cached_tokens": 0}
    info = dict(info or {})
    verify_ct, correct = info.pop("spec_verify_ct", 0), info.pop("spec_num_correct_drafts", 0)
    draft = info.pop("draft_tokens", None)
    if verify_ct > 0 and draft:
        proposed = verify_ct * (draft - 1)
        meta.update({"spec_accept_rate": correct / proposed, "spec_accept_length": len(ids) / verify_ct,
                     "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": proposed,
                     "spec_verify_ct": verify_ct})
    meta.update(info)
    return {"text": decode(ids), "output_ids": list(ids), "meta_info": meta}


def sse(obj):
    """One server-sent event as SGLang's stream_results writes it: b'data: JSON\\n\\n'."""
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


PD_NO_ROOM = "Invalid request: Disaggregated request received without bootstrap room id. req.rid=%r"


def pd_refusal(mode, req):
    """SGLang's error message for /generate request `req` on a server of disaggregation mode
    `mode` ("null", "prefill", "decode"), or None when it is served: a PD worker aborts a request
    whose bootstrap_room is None (see the module docstring)."""
    if mode == "null" or req.get("bootstrap_room") is not None:
        return None
    return PD_NO_ROOM % (req.get("rid"),)


def sglang_version():
    """The sglang release installed next to this interpreter (the host's), or None."""
    try:
        from importlib.metadata import version
        return version("sglang")
    except Exception:
        return None


class Handler(BaseHTTPRequestHandler):
    server_version = "fleetctl-standin"
    state = None  # the StandIn, set in main()

    def setup(self):
        super().setup()
        # each stream event leaves at once (no Nagle wait behind the client's delayed ACK)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt, *args):
        log.info("fleetctl stand-in: %s %s", self.address_string(), fmt % args)

    def reply(self, status, body=None, text=None):
        """Answer with `body` as JSON, or `text` as text/plain, or nothing."""
        data = text.encode() if text is not None else b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None or text is not None:
            self.send_header("Content-Type", "application/json" if text is None else "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def stream(self, req):
        """POST /generate with stream: check the request (BadRequest: HTTP 400, fail_every:
        Injected, HTTP 500: before any event), then HTTP 200 text/event-stream, closed after
        `data: [DONE]`: an event per token, or the error event of a request that fails once
        the stream began (SGLang's stream_results)."""
        s = self.state
        prompts, sp, rids, _, logprobs = s.parse(req)
        s.count("generate", streamed=True)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        try:
            try:
                out = s.run(prompts[0], sp, rids[0], on_chunk=lambda chunk: self.wfile.write(sse(chunk)),
                            logprobs=logprobs)
                self.wfile.write(sse(out))
            except BadRequest as e:
                self.wfile.write(sse({"error": {"message": str(e), "type": "invalid_request_error",
                                                "code": 400, "retryable": False}}))
            self.wfile.write(sse(b"[DONE]"))
        except OSError as e:  # the client went away; SGLang aborts the request then
            log.info("fleetctl stand-in: client disconnected from rid=%s: %s", rids[0], e)
        except Exception:  # the stream ends without [DONE], as SGLang's does on an internal error
            log.exception("fleetctl stand-in: stream rid=%s failed", rids[0])

    def authorized(self):
        """True when the request may go on (see --api-key in the module docstring); else it
        has been answered 401."""
        key, path = self.state.args.api_key, self.path.split("?")[0]
        if not key or path.startswith(("/health", "/ready", "/metrics")):
            return True
        parts = (self.headers.get("Authorization") or "").split(" ", 1)
        if len(parts) == 2 and parts[0].lower() == "bearer" and hmac.compare_digest(parts[1], key):
            return True
        self.reply(401, {"error": "Unauthorized"})
        return False

    def dummy(self, method):
        """A non-zero-rank node's port (see the module docstring): `method` "GET" or another."""
        if self.path.split("?")[0] not in ("/health", "/health_generate", "/ping"):
            return self.reply(404, {"detail": "Not Found"})
        if method != "GET":
            return self.reply(405, {"detail": "Method Not Allowed"})
        self.reply(200 if self.state.healthy() else 503)

    def do_GET(self):
        if self.state.args.node_rank >= 1:
            return self.dummy("GET")
        if not self.authorized():
            return
        s, path = self.state, self.path.split("?")[0]
        if path in ("/health", "/health_generate"):
            if not s.healthy():
                return self.reply(503)
            if path == "/health_generate":  # like SGLang: decode one token from input_ids [0]
                s.engine.generate([0], {"max_new_tokens": 1, "temperature": 0})
            return self.reply(200)
        if path in ("/model_info", "/get_model_info"):
            return self.reply(200, s.model_info())
        if path in ("/server_info", "/get_server_info"):
            return self.reply(200, s.server_info())
        if path == "/v1/models":
            return self.reply(200, s.models())
        if path == "/flush_cache":
            return self.flush()
        if path in INSTRUMENT_ROUTES:
            return self.instrument(path)
        self.reply(404, {"detail": "Not Found"})

    def flush(self):
        """GET/POST /flush_cache[?timeout=S] (S seconds to wait for running requests, default 0)."""
        s = self.state
        if s.engine is None or not s.healthy():
            return self.reply(503, {"error": {"message": "fleetctl stand-in is not ready"}})
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        try:
            timeout = float(query.get("timeout", ["0"])[0])
        except ValueError:
            return self.reply(400, {"detail": "timeout must be a number"})
        status, text = s.flush_cache(max(0.0, timeout))
        self.reply(status, text=text)

    def instrument(self, path):
        """GET/POST an instrument route (StandIn.instrument); a body that is not JSON or not one the
        release takes: 400 (422 before 0.5.2: FastAPI's own, which 0.5.2's http_server.py:302-320
        turns into a 400 ErrorResponse)."""
        s = self.state
        if s.engine is None or not s.healthy():
            return self.reply(503, {"error": {"message": "fleetctl stand-in is not ready"}})
        try:
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else None
            status, text = s.instrument(path, body)
        except (Refused, ValueError) as e:
            status = getattr(e, "status", 400)
            if status == 422 and s.args.release < (0, 5, 2):
                return self.reply(422, {"detail": [{"msg": str(e)}]})
            if status == 422:
                status = 400
            return self.reply(status, {"object": "error", "message": str(e), "type": "Bad Request",
                                       "param": None, "code": status})
        self.reply(status, text=text)

    def do_POST(self):
        if self.state.args.node_rank >= 1:
            return self.dummy("POST")
        if not self.authorized():
            return
        s, path = self.state, self.path.split("?")[0]
        if path == "/flush_cache":
            return self.flush()
        if path in INSTRUMENT_ROUTES:
            return self.instrument(path)
        routes = {"/generate": s.generate, "/v1/completions": s.completions}
        if path not in routes:
            return self.reply(404, {"detail": "Not Found"})
        if s.engine is None or not s.healthy():
            return self.reply(503, {"error": {"message": "fleetctl stand-in is not ready"}})
        try:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if not isinstance(req, dict):
                raise BadRequest("request body must be a JSON object")
            refused = pd_refusal(s.args.disaggregation_mode, req) if path == "/generate" else None
            if refused and req.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.write(sse({"error": {"message": refused}}) + sse(b"[DONE]"))
                return
            if refused:
                log.error("%s", refused)
                return self.reply(400, {"error": {"message": refused}})
            if path == "/generate" and req.get("stream"):
                return self.stream(req)
            self.reply(200, routes[path](req))
        except (BadRequest, ValueError, TypeError) as e:
            self.reply(400, {"error": {"message": str(e), "type": "invalid_request_error", "code": 400}})
        except Injected as e:
            log.info("%s", e)
            self.reply(500, {"error": {"message": str(e), "type": "internal_error", "code": 500}})
        except Exception as e:
            log.exception("fleetctl stand-in: %s failed", path)
            self.reply(500, {"error": {"message": repr(e)}})

    do_PUT = do_POST


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64


def parse_args(argv=None):
    """SGLang-like arguments -> the namespace StandIn takes (`release` added: the SGLang release
    spoken); argparse exits (2) on a refused combination."""
    p = argparse.ArgumentParser(description="fleetctl SGLang stand-in server (not SGLang)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model-path", default="fleetctl-standin/tiny")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--behavior", default=os.path.join(HERE, "behavior.json"))
    p.add_argument("--api-key", default=None)
    for name, default in (("--dp-size", 1), ("--pp-size", 1), ("--nnodes", 1), ("--node-rank", 0),
                          ("--base-gpu-id", 0), ("--gpu-id-step", 1)):
        p.add_argument(name, type=int, default=default)
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--dist-init-addr", "--nccl-init-addr", default=None)
    p.add_argument("--attention-backend", default=None, help="accepted as SGLang takes it; only its command line says it")
    p.add_argument("--speculative-algorithm", default=None, choices=["NGRAM", "STANDALONE"],
                   help="NGRAM: a prompt-lookup draft; STANDALONE: a draft model, here this model's first "
                        "block and head; then a target-verify step over the drafts")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="T: the verify width (default 4)")
    p.add_argument("--speculative-eagle-topk", type=int, default=None, help="accepted as SGLang takes it; 1 only")
    p.add_argument("--speculative-num-steps", type=int, default=None, help="accepted as SGLang takes it")
    p.add_argument("--disaggregation-mode", default="null", choices=["null", "prefill", "decode"])
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--max-total-tokens", type=int, default=MAX_TOTAL_TOKENS,
                   help="the KV pool size /server_info reports as max_total_num_tokens")
    p.add_argument("--ep-size", "--expert-parallel-size", "--ep", dest="ep_size", type=int, default=1,
                   help="ranks the MoE model's experts are split over (ServerArgs.ep_size)")
    p.add_argument("--expert-distribution-recorder-mode", default=None,
                   choices=["stat", "stat_approx", "per_pass", "per_token"])
    p.add_argument("--expert-distribution-recorder-buffer-size", type=int, default=None)
    args = p.parse_args(argv)
    # the SGLang release whose instruments this stand-in speaks: $FLEETCTL_STANDIN_SGLANG (tests),
    # else the one installed beside this interpreter, else the newest modelled (instruments.py)
    args.release = release_key(os.environ.get("FLEETCTL_STANDIN_SGLANG") or sglang_version())
    mode = args.expert_distribution_recorder_mode
    if mode is not None and mode not in recorder_modes(args.release):
        p.error("fleetctl stand-in implements --expert-distribution-recorder-mode %s for SGLang %s"
                % ("/".join(recorder_modes(args.release)), ".".join(map(str, args.release))))
    if mode is not None and args.model_path != MOE_MODEL:  # SGLang asserts so at startup
        p.error(NO_EXPERT_METADATA + " (the MoE model is --model-path %s)" % MOE_MODEL)
    if args.ep_size < 1 or EXPERTS % args.ep_size or args.tp_size % args.ep_size:
        p.error("--ep-size must divide --tp-size and the %d experts" % EXPERTS)
    if args.speculative_num_draft_tokens is not None and args.speculative_num_draft_tokens < 2:
        p.error("--speculative-num-draft-tokens must be at least 2 (the last token and one draft)")
    if args.speculative_eagle_topk not in (None, 1):
        p.error("--speculative-eagle-topk: the stand-in drafts a chain (topk 1) only")
    return args


def main(argv=None):
    """Parse SGLang-like arguments, start listening at once, load the model in the background."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    behavior = load_behavior(args.behavior)
    Handler.state = state = StandIn(args, behavior)
    httpd = Server((args.host, args.port), Handler)
    log.info("fleetctl stand-in (not SGLang) pid %d listening on %s:%d, model_path %s, behaviour %s",
             os.getpid(), args.host, args.port, args.model_path, behavior)
    signal.signal(signal.SIGHUP, lambda *_: state.reload())
    threading.Thread(target=state.load, daemon=True).start()
    httpd.serve_forever()


if __name__ == "__main__":
    main()
