"""fleetctl SGLang STAND-IN server for the lab. This is not SGLang.

A lab host has no GPU and no model, so this stand-in answers SGLang's HTTP API with the same
request and response fields, backed by a tiny decoder-only transformer in torch (seeded
weights, greedy decoding on the CPU with a real KV cache): tokens are deterministic and
latency is real. Every answer that describes the server says `"stand_in": true`, and every
log line starts with "fleetctl stand-in".

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
SIGHUP rereads the behaviour file (the counters of fail_every start again); a file that does not
parse keeps the behaviour there was, and the log says why.
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
257..511 reserved special tokens, the same as encode/decode here.

Stdlib + torch only; never imports fleetctl (it is copied alone onto lab hosts).
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

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.path.join(HERE, "tokenizer")
log = logging.getLogger("fleetctl-standin")

VOCAB, DIM, LAYERS, HEADS, CONTEXT = 512, 64, 2, 4, 2048
EOS = 256  # ids 0..255 are bytes; 256.. are special ids (EOS) and never decode to text
BEHAVIOR_KEYS = {"unhealthy_for_s", "never_healthy", "token_shift", "slowdown", "delay_ms", "truncate_tokens",
                 "contention_ms", "fail_every"}
MAX_TOTAL_TOKENS = 4096  # the KV pool size /server_info reports unless --max-total-tokens
# The subsets of GenerateReqInput / SamplingParams / CompletionRequest fields implemented here;
# any other field is refused with 400 instead of being silently ignored.
GENERATE_KEYS = {"text", "input_ids", "sampling_params", "rid", "stream"}
# GenerateReqInput fields the benchmark clients always send, accepted at these values only
# (0.5.23 benchmark/serving.py async_request_sglang_generate; 0.4.6-0.5.10 bench_serving.py)
OFF_KEYS = {"lora_path": None, "return_logprob": False, "logprob_start_len": -1,
            "return_routed_experts": False, "top_logprobs_num": 0, "token_ids_logprob": None}
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
           "waiting requests, the operation will not be performed.)\n")  # http_server.py flush_cache
SAMPLING_KEYS = {"max_new_tokens", "min_new_tokens", "temperature", "ignore_eos",
                 "stop_token_ids", "sampling_seed", "n"}
COMPLETION_KEYS = {"model", "prompt", "max_tokens", "temperature", "n", "seed", "stream",
                   "ignore_eos", "stop_token_ids", "min_tokens"}


class BadRequest(ValueError):
    """A request the stand-in refuses with HTTP 400 (SGLang answers such with 400 too)."""


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
    return b


def encode(text):
    """Byte-level "tokenizer": UTF-8 bytes are the token ids 0..255."""
    return list(text.encode("utf-8"))


def decode(ids):
    """Inverse of encode; special ids (>= 256) decode to nothing, as with skip_special_tokens."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def build_model(seed):
    """The tiny decoder-only transformer (seeded weights), for CPU inference with a KV cache."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
            self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
            self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

        def forward(self, x, kv):
            t = x.shape[0]
            q, k, v = self.qkv(self.ln1(x)).view(t, 3, HEADS, DIM // HEADS).permute(1, 2, 0, 3)
            if kv is not None:  # decode: append this step's keys/values to the cache
                k, v = torch.cat([kv[0], k], 1), torch.cat([kv[1], v], 1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=kv is None and t > 1)
            x = x + self.proj(a.transpose(0, 1).reshape(t, DIM))
            return x + self.mlp(self.ln2(x)), (k, v)

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(CONTEXT, DIM)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, ids, cache):
            """ids: LongTensor[T]; cache: per-layer (k, v) [HEADS, S, DIM/HEADS] or None."""
            start = cache[0][0].shape[1] if cache else 0
            x = self.tok(ids) + self.pos(torch.arange(start, start + ids.shape[0]))
            new = []
            for i, block in enumerate(self.blocks):
                x, kv = block(x, cache[i] if cache else None)
                new.append(kv)
            return self.head(self.norm(x)), new

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    return TinyLM().eval()


class Engine:
    """One model, one request at a time (a lock plays the scheduler); `inflight` counts the
    requests that have arrived and not finished, the one decoding and those waiting."""

    def __init__(self, seed, behavior):
        import torch
        self.torch = torch
        self.model = build_model(seed)
        self.behavior = behavior
        self.lock = threading.Lock()
        self.inflight = 0
        self.count_lock = threading.Lock()

    def generate(self, prompt, sp, on_token=None):
        """Decode for one prompt. prompt: token ids; sp: sampling params dict (SamplingParams names);
        on_token(output_ids so far), if given, is called after each token (a stream's writer).

        Returns (output_ids, finish_reason dict). Raises BadRequest on invalid input, and what
        on_token raises (a client gone: OSError).
        """
        with self.count_lock:
            self.inflight += 1
        try:
            return self._generate(prompt, sp, on_token)
        finally:
            with self.count_lock:
                self.inflight -= 1

    def _generate(self, prompt, sp, on_token):
        torch = self.torch
        if not prompt or any(not isinstance(i, int) or not 0 <= i < VOCAB for i in prompt):
            raise BadRequest("input_ids must be a non-empty list of ints in [0, %d)" % VOCAB)
        max_new = sp.get("max_new_tokens", 128)
        if max_new is None or max_new < 0:
            raise BadRequest("max_new_tokens must be a non-negative int")
        if len(prompt) + max_new > CONTEXT:
            raise BadRequest("Requested token count exceeds the model's maximum context length "
                             "of %d tokens" % CONTEXT)
        temperature = sp.get("temperature", 1.0)
        temperature = 1.0 if temperature is None else float(temperature)
        stops = set(sp.get("stop_token_ids") or ()) | {EOS}
        gen = torch.Generator().manual_seed(sp.get("sampling_seed") or 0)
        shift = int(self.behavior.get("token_shift", 0))
        slowdown = float(self.behavior.get("slowdown", 1.0))
        delay_s = float(self.behavior.get("delay_ms", 0)) / 1000.0
        contention_s = float(self.behavior.get("contention_ms", 0)) / 1000.0
        truncate = self.behavior.get("truncate_tokens")
        out, cache, finish = [], None, {"type": "length", "length": max_new}
        with self.lock, torch.inference_mode():
            for step in range(max_new):
                t0 = time.perf_counter()
                ids = torch.tensor(out[-1:] if cache else prompt)
                logits, cache = self.model(ids, cache)
                last = logits[-1]
                if temperature < 1e-5:
                    nxt = int(last.argmax())
                else:
                    nxt = int(torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=gen))
                nxt = (nxt + shift) % VOCAB
                out.append(nxt)
                if slowdown > 1.0:
                    time.sleep((slowdown - 1.0) * (time.perf_counter() - t0))
                if delay_s > 0:
                    time.sleep(delay_s)
                if contention_s > 0 and self.inflight > 1:
                    time.sleep(contention_s * (self.inflight - 1))
                if truncate is not None and len(out) >= truncate:
                    return out, {"type": "stop", "matched": EOS}
                if (nxt in stops and not sp.get("ignore_eos", False)
                        and len(out) >= sp.get("min_new_tokens", 0)):
                    return out, {"type": "stop", "matched": nxt}
                if on_token is not None and step < max_new - 1:
                    on_token(out)
        return out, finish


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
            engine = Engine(self.args.random_seed, self.behavior)
            engine.generate([0], {"max_new_tokens": 2, "temperature": 0})
            self.engine = engine
            log.info("fleetctl stand-in: model ready (tiny %d-layer transformer, seed %d, "
                     "behaviour %s)", LAYERS, self.args.random_seed, self.behavior)
        except Exception:  # /health then answers 503 forever; the log says why
            log.exception("fleetctl stand-in: model load failed")

    def healthy(self):
        """True when /health answers 200: loaded, not told to stay unhealthy."""
        b = self.behavior
        return (self.engine is not None and not b.get("never_healthy")
                and time.monotonic() - self.started >= float(b.get("unhealthy_for_s", 0)))

    def run(self, prompt, sp, rid, on_chunk=None):
        """One finished generate result, shaped like TokenizerManager's out dict. on_chunk, if
        given, gets each unfinished one (cumulative text, output_ids, meta_info, finish_reason
        None) as it is decoded: a stream's events."""
        t0 = time.perf_counter()
        on_token = None if on_chunk is None else lambda ids: on_chunk(out_dict(rid, prompt, ids, None))
        ids, finish = self.engine.generate(prompt, sp, on_token)
        out = out_dict(rid, prompt, ids, finish)
        out["meta_info"]["e2e_latency"] = time.perf_counter() - t0
        log.info("fleetctl stand-in: generate rid=%s prompt_tokens=%d completion_tokens=%d "
                 "e2e_latency=%.4fs", rid, len(prompt), len(ids), out["meta_info"]["e2e_latency"])
        return out

    def parse(self, req):
        """Check a GenerateReqInput-shaped dict -> (prompts, sampling params, rids, batch).
        Raises BadRequest for what the stand-in does not implement (a key, or an OFF_KEYS key
        at another value) or an invalid request."""
        unknown = set(req) - GENERATE_KEYS - set(OFF_KEYS)
        if unknown:
            raise BadRequest("fleetctl stand-in does not implement %s" % sorted(unknown))
        on = sorted(k for k in set(req) & set(OFF_KEYS)
                    if not (req[k] is None or (type(req[k]) is type(OFF_KEYS[k]) and req[k] == OFF_KEYS[k])))
        if on:
            raise BadRequest("fleetctl stand-in implements %s only at %s"
                             % (on, {k: OFF_KEYS[k] for k in on}))
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
        return prompts, sp, rids, batch

    def generate(self, req):
        """POST /generate without stream: a GenerateReqInput-shaped dict -> one result or a list
        (batch). Raises BadRequest (HTTP 400)."""
        prompts, sp, rids, batch = self.parse(req)
        self.count("generate")
        outs = [self.run(p, sp, r) for p, r in zip(prompts, rids)]
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
                "model_type": "fleetctl_standin", "architectures": ["FleetctlStandInForCausalLM"],
                "stand_in": True}

    def server_info(self):
        """GET /server_info (and the deprecated /get_server_info): ServerArgs-named fields."""
        a = self.args
        pool = a.max_total_tokens
        engine = self.engine
        return {"model_path": a.model_path, "tokenizer_path": TOKENIZER_DIR, "host": a.host,
                "port": a.port, "tp_size": a.tp_size, "context_length": CONTEXT, **layout(a),
                "random_seed": a.random_seed, "skip_tokenizer_init": False, "page_size": 1,
                "max_running_requests": None, "max_total_tokens": pool,
                "max_total_num_tokens": pool, "max_req_input_len": min(CONTEXT, pool) - 1,
                "weight_version": "default", "version": sglang_version(),
                "internal_states": [{"last_gen_throughput": 0.0, "effective_max_running_requests_per_dp": 1,
                                     "num_running_reqs": engine.inflight if engine else 0}],
                "stand_in": True, "stand_in_behavior": self.behavior, "stand_in_counters": dict(self.counters)}


def layout(a):
    """The multi-node and parallel ServerArgs fields of /server_info, as given on the command line."""
    return {"dp_size": a.dp_size, "pp_size": a.pp_size, "enable_dp_attention": a.enable_dp_attention,
            "nnodes": a.nnodes, "node_rank": a.node_rank, "dist_init_addr": a.dist_init_addr,
            "base_gpu_id": a.base_gpu_id, "gpu_id_step": a.gpu_id_step}


def out_dict(rid, prompt, ids, finish):
    """A generate result as TokenizerManager shapes it: {text, output_ids, meta_info}; ids and
    text cumulative, finish_reason None while unfinished (no e2e_latency then)."""
    return {"text": decode(ids), "output_ids": list(ids), "meta_info": {
        "id": rid, "finish_reason": finish, "prompt_tokens": len(prompt), "weight_version": "default",
        "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": len(ids), "cached_tokens": 0}}


def sse(obj):
    """One server-sent event as SGLang's stream_results writes it: b'data: JSON\\n\\n'."""
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


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
        prompts, sp, rids, _ = s.parse(req)
        s.count("generate", streamed=True)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        try:
            try:
                out = s.run(prompts[0], sp, rids[0], on_chunk=lambda chunk: self.wfile.write(sse(chunk)))
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

    def do_POST(self):
        if self.state.args.node_rank >= 1:
            return self.dummy("POST")
        if not self.authorized():
            return
        s, path = self.state, self.path.split("?")[0]
        if path == "/flush_cache":
            return self.flush()
        routes = {"/generate": s.generate, "/v1/completions": s.completions}
        if path not in routes:
            return self.reply(404, {"detail": "Not Found"})
        if s.engine is None or not s.healthy():
            return self.reply(503, {"error": {"message": "fleetctl stand-in is not ready"}})
        try:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if not isinstance(req, dict):
                raise BadRequest("request body must be a JSON object")
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


def main(argv=None):
    """Parse SGLang-like arguments, start listening at once, load the model in the background."""
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
    p.add_argument("--max-total-tokens", type=int, default=MAX_TOTAL_TOKENS,
                   help="the KV pool size /server_info reports as max_total_num_tokens")
    args = p.parse_args(argv)
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
