"""The stand-in's side of SGLang's benchmark clients, run for real on loopback: the streamed
/generate (server-sent events as SGLang's http_server.py writes them), the request keys the
clients send at their "off" values, /v1/models, /flush_cache, the /server_info fields they read,
the shipped byte-level tokenizer (loaded with transformers, offline), and the behaviours
`contention_ms` and `fail_every`, reread on SIGHUP. Field names are checked against the real
SGLang 0.5.23 wheel."""

import ast
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile

import pytest

from fleetctl.lab import standin
from fleetctl.probes.traffic.smoke import wait_healthy
from fleetctl.wheels import ensure_wheel
from helpers.proc import free_port
from helpers.lab import load_standin

PROMPT = [1, 306, 263, 450, 338, 310, 278, 322]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
# what 0.5.23's benchmark/serving.py async_request_sglang_generate sends besides the prompt
CLIENT_KEYS = {"stream": True, "lora_path": None, "return_logprob": False, "return_routed_experts": False,
               "logprob_start_len": -1}
CONTENTION_MS = 50
# each step of the contended server also takes STEP_MS: 16 steps last long enough (>= 80 ms) for a
# second request, started a thread later on a loaded machine, to arrive while the first decodes
STEP_MS = 5
BEHAVIORS = {"normal": {}, "fail": {"fail_every": 2}, "contended": {"contention_ms": CONTENTION_MS, "delay_ms": STEP_MS},
             "reload": {}}
SRC = {"io_struct": "sglang/srt/managers/io_struct.py", "protocol": "sglang/srt/entrypoints/openai/protocol.py",
       "scheduler": "sglang/srt/managers/scheduler.py", "http_server": "sglang/srt/entrypoints/http_server.py"}


@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    """Parsed 0.5.23 sources: {short name: ast tree}."""
    root = tmp_path_factory.mktemp("sglang")
    with zipfile.ZipFile(ensure_wheel("0.5.23")) as z:
        z.extractall(root, list(SRC.values()))
    return {k: ast.parse((root / f).read_text()) for k, f in SRC.items()}


def class_fields(tree, name):
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One stand-in per behaviour, started together: {name: (port, workdir, process)}."""
    out = {}
    for name, behavior in BEHAVIORS.items():
        d = tmp_path_factory.mktemp(name)
        port = free_port()
        out[name] = (port, d, standin.start_local(port, behavior, d))
    for name, (port, _, _) in out.items():
        assert wait_healthy("http://127.0.0.1:%d" % port, 60)[0], name
    yield out
    for _, _, p in out.values():
        p.terminate()
        p.wait(10)


def request(port, method, path, body=None, timeout=60):
    """(status, headers {lower name: value}, whole body bytes): the server closes a stream when done."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request(method, path, body=None if body is None else json.dumps(body),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, data


def events(data):
    """The SSE events of a stream body: each `data: X` block, X parsed as JSON unless [DONE]."""
    assert data.endswith(b"\n\n"), data[-80:]
    out = []
    for block in data.split(b"\n\n")[:-1]:
        assert block.startswith(b"data: "), block[:80]
        payload = block[len(b"data: "):]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def stream(port, body):
    status, headers, data = request(port, "POST", "/generate", body)
    assert status == 200 and headers["content-type"] == "text/event-stream", (status, data[:300])
    return events(data)


def server_info(port):
    status, _, data = request(port, "GET", "/server_info")
    assert status == 200
    return json.loads(data)


def test_stream_events_are_sglangs(servers):
    port = servers["normal"][0]
    evs = stream(port, {"input_ids": PROMPT, "sampling_params": GREEDY, **CLIENT_KEYS})
    assert evs[-1] == "[DONE]" and "[DONE]" not in evs[:-1]
    chunks = evs[:-1]
    assert len(chunks) == GREEDY["max_new_tokens"]  # one event per token
    for i, c in enumerate(chunks, 1):  # cumulative, SGLang's default (not incremental) streaming
        assert set(c) == {"text", "output_ids", "meta_info"}
        assert len(c["output_ids"]) == c["meta_info"]["completion_tokens"] == i
        assert c["output_ids"][:-1] == (chunks[i - 2]["output_ids"] if i > 1 else [])
        assert c["meta_info"]["prompt_tokens"] == len(PROMPT)
        assert (c["meta_info"]["finish_reason"] is None) == (i < len(chunks))
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": GREEDY["max_new_tokens"]}
    assert 0 < last["meta_info"]["e2e_latency"] < 30 and "e2e_latency" not in chunks[0]["meta_info"]
    # the same tokens and text as without stream
    status, _, data = request(port, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    plain = json.loads(data)
    assert status == 200 and plain["output_ids"] == last["output_ids"] and plain["text"] == last["text"]
    # the text a client reads is the server's decode of the ids so far, at every event
    engine = load_standin(standin.ENGINE)
    assert all(c["text"] == engine.decode(c["output_ids"]) for c in chunks)


def test_stream_text_prompt_and_refusals(servers):
    port = servers["normal"][0]
    evs = stream(port, {"text": "Hello", "sampling_params": GREEDY, **CLIENT_KEYS})
    assert evs[-2]["meta_info"]["prompt_tokens"] == 5 and evs[-1] == "[DONE]"
    # the "off" keys at any other value, and a streamed batch, are refused before any event
    for key, on in (("lora_path", "adapter"), ("return_routed_experts", True), ("return_logprob", "yes"),
                    ("top_logprobs_num", -2), ("logprob_start_len", 1.5)):
        status, headers, data = request(port, "POST", "/generate",
                                        {"input_ids": PROMPT, "sampling_params": GREEDY, **CLIENT_KEYS, key: on})
        assert status == 400 and key in json.loads(data)["error"]["message"], (key, data)
    status, _, data = request(port, "POST", "/generate", {"text": ["a", "b"], "stream": True})
    assert status == 400 and "batch" in json.loads(data)["error"]["message"]


def test_error_after_the_stream_began_is_an_error_event(servers):
    """As SGLang's stream_results: HTTP 200, then {"error": {...}} and [DONE] (a ValueError raised
    by the engine once the response started: here the context length)."""
    server = load_standin()
    port = servers["normal"][0]
    evs = stream(port, {"input_ids": [1] * (server.CONTEXT - 8), "sampling_params": GREEDY, **CLIENT_KEYS})
    assert len(evs) == 2 and evs[1] == "[DONE]"
    err = evs[0]["error"]
    assert set(err) == {"message", "type", "code", "retryable"} and "context length" in err["message"]
    assert (err["type"], err["code"], err["retryable"]) == ("invalid_request_error", 400, False)


def test_off_keys_and_routes_are_sglangs(servers, sglang):
    server = load_standin()
    assert set(server.OFF_KEYS) | set(server.LOGPROB_KEYS) <= class_fields(sglang["io_struct"], "GenerateReqInput")
    port = servers["normal"][0]
    status, _, data = request(port, "GET", "/v1/models")
    models = json.loads(data)
    assert status == 200 and set(models) == class_fields(sglang["protocol"], "ModelList")
    (card,) = models["data"]
    assert set(card) == class_fields(sglang["protocol"], "ModelCard")
    assert card["id"] == "fleetctl-standin/tiny" and card["max_model_len"] == server.CONTEXT
    before = server_info(port)["stand_in_counters"]["flush_cache"]
    for method, path in (("POST", "/flush_cache?timeout=60"), ("GET", "/flush_cache")):
        status, headers, data = request(port, method, path)
        assert status == 200 and data.decode().startswith("Cache flushed.\n")
        assert headers["content-type"].startswith("text/plain")
    info = server_info(port)
    assert info["stand_in_counters"]["flush_cache"] == before + 2
    # the scheduler's init info (scheduler.py get_init_info) that /server_info carries, under its names
    init = next(n for n in ast.walk(sglang["scheduler"]) if isinstance(n, ast.FunctionDef) and n.name == "get_init_info")
    keys = {k.value for n in ast.walk(init) if isinstance(n, ast.Dict) for k in n.keys if isinstance(k, ast.Constant)}
    assert {"max_total_num_tokens", "max_req_input_len"} <= keys
    assert info["max_total_num_tokens"] == server.MAX_TOTAL_TOKENS and info["max_req_input_len"] == server.CONTEXT - 1
    assert isinstance(info["internal_states"][0], dict)  # 0.4.6 / 0.5.2 read internal_states[0]
    status, _, data = request(port, "GET", "/model_info")
    assert json.loads(data)["tokenizer_path"] == os.path.join(os.path.dirname(standin.SERVER), "tokenizer")


def test_tokenizer_is_the_servers_byte_encoding():
    """transformers' AutoTokenizer loads the shipped directory offline, as the clients do, and it
    encodes and decodes as engine.py does: id i = byte i, 256 <eos>, 257..511 special. Run in an
    interpreter of its own, as the clients run: in this one, a test that imported ansible-core has
    patched sys.intern, which torch (imported by transformers) cannot take."""
    server, engine = load_standin(), load_standin(standin.ENGINE)
    texts = ["Hello, world", "héllo wörld ✓", " two  spaces\n"]
    ids = [72, 105, 256, 300, 511, 195, 169, 33]
    script = ("import json, sys\nfrom transformers import AutoTokenizer\n"
              "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
              "texts, ids = json.loads(sys.argv[2]), json.loads(sys.argv[3])\n"
              "print(json.dumps({'vocab_size': tok.vocab_size, 'len': len(tok), 'eos': tok.eos_token_id,"
              " 'encoded': [tok.encode(t, add_special_tokens=False) for t in texts],"
              " 'decoded': tok.decode(ids, skip_special_tokens=True)}))\n")
    r = subprocess.run([sys.executable, "-c", script, str(server.TOKENIZER_DIR), json.dumps(texts), json.dumps(ids)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert (got["vocab_size"], got["len"], got["eos"]) == (256, engine.VOCAB, engine.EOS)
    assert got["encoded"] == [engine.encode(t) for t in texts]
    assert got["decoded"] == engine.decode(ids) == "Hié!"


def test_fail_every_counts_streamed_requests_only(servers):
    port = servers["fail"][0]
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, **CLIENT_KEYS}
    assert stream(port, body)[-1] == "[DONE]"  # streamed #1
    for _ in range(3):  # not streamed (a smoke decode): never failed, not counted
        status, _, _ = request(port, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
        assert status == 200
    status, headers, data = request(port, "POST", "/generate", body)  # streamed #2: fails before any event
    err = json.loads(data)["error"]
    assert status == 500 and headers["content-type"] == "application/json"
    assert err["code"] == 500 and "fail_every 2" in err["message"]
    assert stream(port, body)[-1] == "[DONE]"  # #3


def test_contention_slows_concurrent_requests_only(servers):
    port = servers["contended"][0]
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 16}, **CLIENT_KEYS}

    def e2e():
        return stream(port, body)[-2]["meta_info"]["e2e_latency"]

    steps_s = 16 * CONTENTION_MS / 1000  # 16 decode steps, each slowed for one other request in flight
    alone = e2e()
    assert alone < steps_s / 4 + 16 * STEP_MS / 1000  # no other request in flight: no slowdown
    got = []
    threads = [threading.Thread(target=lambda: got.append(e2e())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # one decodes at a time: the first had the other in flight from its arrival on (most steps)
    assert max(got) >= steps_s / 2


def test_sighup_rereads_the_behaviour(servers):
    port, d, proc = servers["reload"]
    assert server_info(port)["stand_in_behavior"] == {}
    (d / "behavior.json").write_text(json.dumps({"fail_every": 1}))
    os.kill(proc.pid, signal.SIGHUP)
    wait_for(lambda: server_info(port)["stand_in_behavior"] == {"fail_every": 1})
    assert request(port, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, **CLIENT_KEYS})[0] == 500
    (d / "behavior.json").write_text('{"fail_every": 1, "no_such_behaviour": 1}')  # refused: kept as it was
    os.kill(proc.pid, signal.SIGHUP)
    wait_for(lambda: "behaviour not reloaded" in (d / "server.log").read_text())
    assert server_info(port)["stand_in_behavior"] == {"fail_every": 1}
    (d / "behavior.json").write_text("{}")
    os.kill(proc.pid, signal.SIGHUP)
    wait_for(lambda: server_info(port)["stand_in_behavior"] == {})
    assert proc.poll() is None  # the same process throughout


def test_python_clients_of_0510_and_0523_import_torchvision():
    """Why the lab runs those two releases' Python clients nowhere (scripts/setup.sh): on their
    import path sits a module-level torchvision import (0.5.10 bench_serving.py -> sglang.srt.utils
    -> common.py; 0.5.23 benchmark/serving.py -> srt.disaggregation.utils -> srt.configs ->
    nano_nemotron_vl.py -> srt/multimodal/internvl_utils.py), and PyPI's torchvision is a CUDA
    build that does not load against this machine's CPU torch."""
    for release, path in (("0.5.10", "sglang/srt/utils/common.py"),
                          ("0.5.23", "sglang/srt/multimodal/internvl_utils.py")):
        with zipfile.ZipFile(ensure_wheel(release)) as z:
            tree = ast.parse(z.read(path))
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert any(a.name.split(".")[0] == "torchvision" for n in top if isinstance(n, ast.Import) for a in n.names) \
            or any((n.module or "").split(".")[0] == "torchvision" for n in top if isinstance(n, ast.ImportFrom)), path


def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)
