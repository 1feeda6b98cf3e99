"""fleetctl SGLang STAND-IN server for the lab. This is not SGLang.

A lab host has no GPU and no model, so this stand-in answers SGLang's HTTP API with the same
request and response fields, backed by a tiny decoder-only transformer in torch (seeded
weights, greedy decoding on the CPU with a real KV cache): tokens are deterministic and
latency is real. Every answer that describes the server says `"stand_in": true`, and every
log line starts with "fleetctl stand-in".

Shapes follow the installed SGLang releases (0.5.23, cross-checked with 0.5.10):
- routes `/health`, `/health_generate` (503 while starting), `/generate`, `/server_info`,
  `/get_server_info`, `/model_info`, `/get_model_info`, `/v1/completions`:
  sglang/srt/entrypoints/http_server.py;
- the `/generate` request (`text` or `input_ids`, `sampling_params`, `rid`, `stream`):
  `GenerateReqInput` in sglang/srt/managers/io_struct.py;
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
`--api-key KEY` protects every route but /health*, /ready* and /metrics* as SGLang's does
(sglang/srt/utils/auth.py `decide_request_auth`, 0.5.23): `Authorization: Bearer KEY`, else 401.

Stdlib + torch only; never imports fleetctl (it is copied alone onto lab hosts).
Usage: python server.py --host 127.0.0.1 --port 30000 --model-path fleetctl-standin/tiny
"""

import argparse
import hmac
import json
import logging
import os
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = os.path.dirname(os.path.abspath(__file__))
log = logging.getLogger("fleetctl-standin")

VOCAB, DIM, LAYERS, HEADS, CONTEXT = 512, 64, 2, 4, 2048
EOS = 256  # ids 0..255 are bytes; 256.. are special ids (EOS) and never decode to text
BEHAVIOR_KEYS = {"unhealthy_for_s", "never_healthy", "token_shift", "slowdown", "delay_ms", "truncate_tokens"}
# The subsets of GenerateReqInput / SamplingParams / CompletionRequest fields implemented here;
# any other field is refused with 400 instead of being silently ignored.
GENERATE_KEYS = {"text", "input_ids", "sampling_params", "rid", "stream"}
SAMPLING_KEYS = {"max_new_tokens", "min_new_tokens", "temperature", "ignore_eos",
                 "stop_token_ids", "sampling_seed", "n"}
COMPLETION_KEYS = {"model", "prompt", "max_tokens", "temperature", "n", "seed", "stream",
                   "ignore_eos", "stop_token_ids", "min_tokens"}


class BadRequest(ValueError):
    """A request the stand-in refuses with HTTP 400 (SGLang answers such with 400 too)."""


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
    """One model, one request at a time (a lock plays the scheduler)."""

    def __init__(self, seed, behavior):
        import torch
        self.torch = torch
        self.model = build_model(seed)
        self.behavior = behavior
        self.lock = threading.Lock()

    def generate(self, prompt, sp):
        """Decode for one prompt. prompt: token ids; sp: sampling params dict (SamplingParams names).

        Returns (output_ids, finish_reason dict). Raises BadRequest on invalid input.
        """
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
                if truncate is not None and len(out) >= truncate:
                    return out, {"type": "stop", "matched": EOS}
                if (nxt in stops and not sp.get("ignore_eos", False)
                        and len(out) >= sp.get("min_new_tokens", 0)):
                    return out, {"type": "stop", "matched": nxt}
        return out, finish


class StandIn:
    """Server state: configuration, behaviour, the engine once loaded, startup time."""

    def __init__(self, args, behavior):
        self.args, self.behavior = args, behavior
        self.started = time.monotonic()
        self.engine = None

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

    def run(self, prompt, sp, rid):
        """One finished generate result, shaped like TokenizerManager's out dict."""
        t0 = time.perf_counter()
        ids, finish = self.engine.generate(prompt, sp)
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "e2e_latency": time.perf_counter() - t0,
        }
        log.info("fleetctl stand-in: generate rid=%s prompt_tokens=%d completion_tokens=%d "
                 "e2e_latency=%.4fs", rid, len(prompt), len(ids), meta["e2e_latency"])
        return {"text": decode(ids), "output_ids": ids, "meta_info": meta}

    def generate(self, req):
        """POST /generate: a GenerateReqInput-shaped dict -> one result or a list (batch)."""
        unknown = set(req) - GENERATE_KEYS
        if unknown:
            raise BadRequest("fleetctl stand-in does not implement %s" % sorted(unknown))
        if req.get("stream"):
            raise BadRequest("fleetctl stand-in does not implement stream=true")
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
        outs = [self.run(p, sp, r) for p, r in zip(prompts, rids)]
        return outs if batch else outs[0]

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
        return {"model_path": a.model_path, "tokenizer_path": a.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": "fleetctl_standin", "architectures": ["FleetctlStandInForCausalLM"],
                "stand_in": True}

    def server_info(self):
        """GET /server_info (and the deprecated /get_server_info): ServerArgs-named fields."""
        a = self.args
        return {"model_path": a.model_path, "tokenizer_path": a.model_path, "host": a.host,
                "port": a.port, "tp_size": a.tp_size, "dp_size": 1, "context_length": CONTEXT,
                "random_seed": a.random_seed, "skip_tokenizer_init": False,
                "weight_version": "default", "internal_states": [], "version": sglang_version(),
                "stand_in": True, "stand_in_behavior": self.behavior}


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

    def log_message(self, fmt, *args):
        log.info("fleetctl stand-in: %s %s", self.address_string(), fmt % args)

    def reply(self, status, body=None):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

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

    def do_GET(self):
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
        self.reply(404, {"detail": "Not Found"})

    def do_POST(self):
        if not self.authorized():
            return
        s, path = self.state, self.path.split("?")[0]
        routes = {"/generate": s.generate, "/v1/completions": s.completions}
        if path not in routes:
            return self.reply(404, {"detail": "Not Found"})
        if s.engine is None or not s.healthy():
            return self.reply(503, {"error": {"message": "fleetctl stand-in is not ready"}})
        try:
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if not isinstance(req, dict):
                raise BadRequest("request body must be a JSON object")
            self.reply(200, routes[path](req))
        except (BadRequest, ValueError, TypeError) as e:
            self.reply(400, {"error": {"message": str(e), "type": "invalid_request_error", "code": 400}})
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
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    behavior = load_behavior(args.behavior)
    Handler.state = state = StandIn(args, behavior)
    httpd = Server((args.host, args.port), Handler)
    log.info("fleetctl stand-in (not SGLang) pid %d listening on %s:%d, model_path %s, behaviour %s",
             os.getpid(), args.host, args.port, args.model_path, behavior)
    threading.Thread(target=state.load, daemon=True).start()
    httpd.serve_forever()


if __name__ == "__main__":
    main()
