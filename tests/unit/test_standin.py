"""The lab's SGLang stand-in server, run for real on loopback, checked against the field names
in the real SGLang 0.5.23 wheel (0.5.10 for the ServerArgs dataclass behind /server_info)."""

import ast
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zipfile

import pytest

from fleetctl.lab import standin
from fleetctl.probes.traffic.smoke import wait_healthy
from fleetctl.wheels import ensure_wheel
from helpers.proc import alive, free_port
from helpers.lab import load_standin

PROMPT = [1, 306, 263, 450, 338, 310, 278, 322]
GREEDY16 = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
BEHAVIORS = {"normal": {}, "shift": {"token_shift": 1}, "never": {"never_healthy": True},
             "slow": {"slowdown": 3.0}, "late": {"unhealthy_for_s": 4}, "delay": {"delay_ms": 20}}
SRC_FILES = ["sglang/srt/entrypoints/http_server.py", "sglang/srt/managers/io_struct.py",
             "sglang/srt/managers/tokenizer_manager.py", "sglang/srt/managers/schedule_batch.py",
             "sglang/srt/sampling/sampling_params.py", "sglang/srt/entrypoints/openai/protocol.py"]


def http(port, path, body=None, timeout=30):
    """(status, parsed JSON body or None) of one request to the stand-in."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    return status, json.loads(raw) if raw else None


def class_fields(tree, name):
    """Annotated field names of class `name` in an ast tree (dataclass / pydantic / msgspec)."""
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


def dict_keys(node):
    return {k.value for k in node.keys if isinstance(k, ast.Constant)}


@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    """Parsed sources of the real SGLang releases: {short name: ast tree}."""
    root = tmp_path_factory.mktemp("sglang")
    with zipfile.ZipFile(ensure_wheel("0.5.23")) as z:
        z.extractall(root / "0.5.23", SRC_FILES)
    with zipfile.ZipFile(ensure_wheel("0.5.10")) as z:
        z.extractall(root / "0.5.10", ["sglang/srt/server_args.py"])
    trees = {os.path.basename(f)[:-3]: ast.parse((root / "0.5.23" / f).read_text()) for f in SRC_FILES}
    trees["server_args_0510"] = ast.parse((root / "0.5.10/sglang/srt/server_args.py").read_text())
    return trees


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One stand-in per behaviour, started together: {name: port}; `late` is watched from start."""
    procs, ports = [], {}
    t0 = time.monotonic()
    for name, behavior in BEHAVIORS.items():
        d = tmp_path_factory.mktemp(name)
        ports[name] = free_port()
        procs.append(standin.start_local(ports[name], behavior, d))
    seen = []  # (seconds since t0, status or None) of /health on the `late` server

    def watch():
        while time.monotonic() - t0 < 60:
            try:
                status = http(ports["late"], "/health", timeout=5)[0]
            except OSError:
                status = None
            seen.append((time.monotonic() - t0, status))
            if status == 200:
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    for name in ("normal", "shift", "slow"):
        assert wait_healthy("http://127.0.0.1:%d" % ports[name], 60)[0], name
    ports["late_seen"], ports["late_watcher"] = seen, watcher
    yield ports
    watcher.join()
    for p in procs:
        p.terminate()
        p.wait(10)


def generate(port, body):
    status, out = http(port, "/generate", body)
    assert status == 200, out
    return out


def test_generate_shapes_are_sglangs(servers, sglang):
    out = generate(servers["normal"], {"input_ids": PROMPT, "sampling_params": GREEDY16})
    assert set(out) == {"text", "output_ids", "meta_info"}
    # every meta_info key the stand-in emits is one TokenizerManager sets
    real = set()
    for n in ast.walk(sglang["tokenizer_manager"]):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict) and any(
                isinstance(t, ast.Name) and t.id == "meta_info" for t in n.targets):
            real |= dict_keys(n.value)
        elif (isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store)
              and isinstance(n.value, ast.Name) and n.value.id == "meta_info"
              and isinstance(n.slice, ast.Constant)):
            real.add(n.slice.value)
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "update"
              and isinstance(n.func.value, ast.Name) and n.func.value.id == "meta_info"
              and n.args and isinstance(n.args[0], ast.Dict)):
            real |= dict_keys(n.args[0])
    meta = out["meta_info"]
    assert set(meta) <= real, set(meta) - real
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
            "e2e_latency"} <= set(meta)
    # finish_reason is FINISH_LENGTH.to_json()
    fl = next(n for n in ast.walk(sglang["schedule_batch"])
              if isinstance(n, ast.ClassDef) and n.name == "FINISH_LENGTH")
    ret = next(n for n in ast.walk(fl) if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict))
    assert set(meta["finish_reason"]) == dict_keys(ret.value)
    assert meta["finish_reason"] == {"type": "length", "length": 16}
    assert len(out["output_ids"]) == meta["completion_tokens"] == 16
    assert meta["prompt_tokens"] == len(PROMPT) and 0 < meta["e2e_latency"] < 10
    # what the stand-in accepts is named as in GenerateReqInput / SamplingParams
    server = load_standin()
    assert server.GENERATE_KEYS <= class_fields(sglang["io_struct"], "GenerateReqInput")
    assert server.SAMPLING_KEYS <= class_fields(sglang["sampling_params"], "SamplingParams")
    assert server.COMPLETION_KEYS - {"ignore_eos", "stop_token_ids", "min_tokens"} <= \
        class_fields(sglang["protocol"], "CompletionRequest")


def test_text_batch_and_refusals(servers):
    port = servers["normal"]
    one = generate(port, {"text": "Hello", "sampling_params": GREEDY16})
    assert one["meta_info"]["prompt_tokens"] == 5 and len(one["output_ids"]) == 16
    assert isinstance(one["text"], str)
    batch = generate(port, {"text": ["Hello", "Hi"], "sampling_params": GREEDY16})
    assert [b["output_ids"] for b in batch][0] == one["output_ids"] and len(batch) == 2
    assert generate(port, {"input_ids": [PROMPT, PROMPT], "sampling_params": GREEDY16})[1]["output_ids"] \
        == generate(port, {"input_ids": PROMPT, "sampling_params": GREEDY16})["output_ids"]
    status, err = http(port, "/generate", {"input_ids": PROMPT, "sampling_params": {"top_p": 0.5}})
    assert status == 400 and "top_p" in err["error"]["message"]
    assert http(port, "/generate", {"sampling_params": GREEDY16})[0] == 400
    assert http(port, "/generate", {"input_ids": [99999]})[0] == 400
    assert http(port, "/nope")[0] == 404


def test_info_endpoints(servers, sglang):
    port = servers["normal"]
    status, info = http(port, "/server_info")
    assert status == 200 and http(port, "/get_server_info") == (200, info)
    assert info["stand_in"] is True and info["model_path"] == "fleetctl-standin/tiny"
    assert info["port"] == port
    args_fields = class_fields(sglang["server_args_0510"], "ServerArgs")
    # + the scheduler's init info (checked against scheduler.py in test_standin_stream.py)
    assert set(info) - args_fields == {"internal_states", "version", "stand_in", "stand_in_behavior",
                                       "stand_in_counters", "max_total_num_tokens", "max_req_input_len"}
    status, mi = http(port, "/model_info")
    assert status == 200 and http(port, "/get_model_info") == (200, mi)
    fn = next(n for n in ast.walk(sglang["http_server"])
              if isinstance(n, ast.AsyncFunctionDef) and n.name == "model_info")
    real = next(dict_keys(n.value) for n in ast.walk(fn)
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict))
    assert set(mi) - real == {"stand_in"} and "model_path" in mi
    assert http(port, "/health_generate")[0] == 200


def test_v1_completions(servers, sglang):
    status, out = http(servers["normal"], "/v1/completions",
                       {"model": "x", "prompt": "Hello", "max_tokens": 16, "temperature": 0,
                        "ignore_eos": True})
    assert status == 200
    assert set(out) <= class_fields(sglang["protocol"], "CompletionResponse")
    assert set(out["choices"][0]) <= class_fields(sglang["protocol"], "CompletionResponseChoice")
    assert set(out["usage"]) <= class_fields(sglang["protocol"], "UsageInfo")
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 16
    native = generate(servers["normal"], {"text": "Hello", "sampling_params": GREEDY16})
    assert out["choices"][0]["text"] == native["text"]


def test_deterministic_and_token_shift(servers):
    body = {"input_ids": PROMPT, "sampling_params": GREEDY16}
    a = generate(servers["normal"], body)["output_ids"]
    assert generate(servers["normal"], body)["output_ids"] == a
    assert len(set(a)) > 1  # a real model, not a constant
    shifted = generate(servers["shift"], body)["output_ids"]
    assert shifted != a and len(shifted) == 16


def test_kv_cache_decode_equals_full_recompute():
    mod = load_standin(standin.ENGINE)
    import torch
    engine = mod.Engine(0, {})
    ids, finish, _ = engine.generate(PROMPT, GREEDY16)
    seq = list(PROMPT)
    with torch.inference_mode():
        for _ in range(16):  # the whole sequence again each time, in fresh slots of a fresh pool
            pool = mod.KVPool(torch, len(seq))
            logits = engine.model(torch.tensor(seq), torch.arange(len(seq)), pool,
                                  mod.Step(torch.empty(0, dtype=torch.int64), pool.alloc(len(seq))))
            seq.append(int(logits[-1].argmax()))
    assert seq[len(PROMPT):] == ids and finish == {"type": "length", "length": 16}
    assert len(engine.pool.free_slots) == engine.pool.size  # every slot back in the free list


def test_never_healthy(servers):
    port = servers["never"]
    assert not wait_healthy("http://127.0.0.1:%d" % port, 1.0)[0]
    assert http(port, "/health")[0] == 503
    assert http(port, "/generate", {"input_ids": PROMPT})[0] == 503
    assert http(port, "/server_info")[1]["stand_in_behavior"] == {"never_healthy": True}


def test_unhealthy_for_s_then_healthy(servers):
    servers["late_watcher"].join()
    seen = servers["late_seen"]
    answered = [(t, s) for t, s in seen if s is not None]
    assert answered[0][1] == 503  # "still starting" before it was healthy
    first_ok = next(t for t, s in answered if s == 200)
    assert first_ok >= BEHAVIORS["late"]["unhealthy_for_s"]
    assert all(s == 503 for t, s in answered if t < first_ok)


def test_slowdown_is_slower(servers):
    body = {"input_ids": PROMPT, "sampling_params": GREEDY16}

    def median_e2e(port):
        return statistics.median(generate(port, body)["meta_info"]["e2e_latency"] for _ in range(5))

    # 3x the measured decode steps; the request's own overhead is not slowed, and on 2 busy cores
    # (the machine room runs beside this one) it is a good part of 16 tokens' time
    assert median_e2e(servers["slow"]) > 1.4 * median_e2e(servers["normal"])
    # a fixed delay: 16 steps x 20 ms more than the normal server, whatever this machine's speed
    assert median_e2e(servers["delay"]) >= median_e2e(servers["normal"]) + 16 * 0.020


def test_restart_sh_in_a_copied_dir(tmp_path):
    d = tmp_path / "fleetctl-standin"
    d.mkdir()
    for f in standin.FILES:
        shutil.copy2(f, d)
    port = free_port()
    env = dict(os.environ, PYTHON=sys.executable)
    cmd = ["sh", str(d / "restart.sh"), "--port", str(port)]
    t0 = time.monotonic()
    subprocess.run(cmd, env=env, check=True, timeout=30)
    assert time.monotonic() - t0 < 5  # returns at once; the health wait is the caller's
    first = int((d / "server.pid").read_text())
    try:
        assert wait_healthy("http://127.0.0.1:%d" % port, 60)[0]
        subprocess.run(cmd, env=env, check=True, timeout=30)
        second = int((d / "server.pid").read_text())
        assert second != first and not alive(first)
        assert wait_healthy("http://127.0.0.1:%d" % port, 60)[0]
        assert "server.py" in open("/proc/%d/cmdline" % second).read()
        assert "fleetctl stand-in" in (d / "server.log").read_text()
    finally:
        last = int((d / "server.pid").read_text())  # the server this test started, by its pid
        os.kill(last, 15)
        deadline = time.monotonic() + 10
        while alive(last) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(last)
