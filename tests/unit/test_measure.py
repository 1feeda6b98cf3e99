"""engine/kernels/measure.py (the measured dispatch table) and probes/traffic/serverinfo.py, on hand-made figures: the
per-rank shapes from /server_info and config.json, the >= 1.1x-at-every-prefix choice, measured_table over
fake probe answers (every failure a source "none" table, never an exception), and the config.json reader's
refusals. No GPU here: the CUDA timing itself (dispatch_bench.py) is not run by these tests."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from fleetctl.engine.kernels import measure
from fleetctl.errors import ProbeFailed
from fleetctl.probes.traffic import serverinfo

INFO = {"tp_size": 1, "dp_size": 1, "enable_dp_attention": False, "speculative_algorithm": "EAGLE",
        "speculative_num_draft_tokens": 4, "speculative_eagle_topk": 1, "page_size": 1, "kv_cache_dtype": "auto",
        "dtype": "auto", "model_path": "/models/m", "context_length": 32768, "attention_backend": "triton",
        "cuda_graph_max_bs": 8}
LLAMA8B = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "torch_dtype": "bfloat16"}


def one(info=None, config=None, **kw):
    shapes, why = measure.shapes_and_why([dict(info or INFO, **kw)], [config if config is not None else LLAMA8B])
    return shapes, why


def test_llama_shape_per_rank():
    [s], why = one()
    assert why == []
    assert (s["head_dim"], s["group"], s["draft_tokens"], s["dtype"]) == (128, 4, 4, "bfloat16")
    assert (s["q_heads"], s["kv_heads"], s["topk"], s["batches"]) == (32, 8, 1, [1, 2, 4, 8])


def test_group_is_per_rank_after_dividing_by_tp():
    # 32 query heads, 8 KV heads over TP 16: 2 query heads and max(1, 8 // 16) = 1 KV head per rank
    [s], _ = one(tp_size=16)
    assert (s["q_heads"], s["kv_heads"], s["group"]) == (2, 1, 2)
    [s], _ = one(tp_size=4)
    assert (s["q_heads"], s["kv_heads"], s["group"]) == (8, 2, 4)
    # DP attention: attention TP = tp / dp
    [s], _ = one(tp_size=8, dp_size=4, enable_dp_attention=True)
    assert (s["q_heads"], s["kv_heads"]) == (16, 4)


def test_head_dim_given_wins_over_hidden_size():
    # Qwen3-style: head_dim 128 though hidden_size / heads is 64
    [s], _ = one(config={"num_attention_heads": 32, "num_key_value_heads": 4, "hidden_size": 2048,
                         "head_dim": 128, "torch_dtype": "bfloat16"})
    assert s["head_dim"] == 128 and s["group"] == 8
    [s], _ = one(config={"num_attention_heads": 32, "num_key_value_heads": 4, "hidden_size": 2048,
                         "torch_dtype": "bfloat16"})
    assert s["head_dim"] == 64


def test_text_config_and_dtypes():
    [s], _ = one(config={"text_config": dict(LLAMA8B, torch_dtype="float16")})
    assert s["head_dim"] == 128 and s["dtype"] == "float16"
    [s], _ = one(config=dict(LLAMA8B, torch_dtype="float32"))   # auto: FP16 for FP32 models
    assert s["dtype"] == "float16"
    [s], _ = one(dtype="bfloat16", config=dict(LLAMA8B, torch_dtype="float16"))
    assert s["dtype"] == "bfloat16"


@pytest.mark.parametrize("change, said", [
    ({"speculative_algorithm": None}, "does not speculate"),
    ({"attention_backend": "flashinfer"}, "triton backend only"),
    ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype fp8_e4m3"),
    ({"tp_size": 3}, "does not split over attention TP 3"),
    ({"speculative_num_draft_tokens": True}, "speculative_num_draft_tokens missing"),
])
def test_servers_left_out_say_why(change, said):
    shapes, why = one(**change)
    assert shapes == [] and len(why) == 1 and said in why[0]


def test_batches_capped_and_merged():
    shapes = measure.shapes_for([dict(INFO, cuda_graph_max_bs=2), dict(INFO, cuda_graph_max_bs=4)], [LLAMA8B] * 2)
    assert len(shapes) == 1 and shapes[0]["batches"] == [1, 2, 4]
    assert measure.shapes_for([dict(INFO, cuda_graph_max_bs=None)], [LLAMA8B])[0]["batches"] == [1, 2, 4, 8, 16, 32]


def rows(table):
    """dispatch_bench results from {batch: [speedup per prefix]} (prefixes 1024, 4096)."""
    return [{"batch": b, "prefix": p, "speedup": s, "agree": True, "ms_build": 1.0, "ms_sglang": s}
            for b, sp in table.items() for p, s in zip((1024, 4096), sp)]


SHAPE = {"head_dim": 128, "group": 4, "draft_tokens": 4, "dtype": "bfloat16", "q_heads": 32, "kv_heads": 8, "topk": 1}


def test_enabled_only_at_every_prefix():
    m = dict(SHAPE, results=rows({1: [1.5, 1.2], 2: [1.4, 1.3], 4: [1.6, 1.05], 8: [2.0, 2.0]}))
    [e], [rec] = measure.choose([m])
    # batch 4 misses at 4096: max_batch 2 (batch 8, though faster, is beyond a bucket that missed)
    assert e == {"head_dim": 128, "group": 4, "draft_tokens": 4, "dtype": "bfloat16", "max_batch": 2,
                 "speedup": [1.4, 1.2]}
    assert rec["enabled"] and rec["max_batch"] == 2 and rec["speedups"]["4"] == [1.6, 1.05]


def test_exactly_the_bar_is_met_and_one_table_key_keeps_its_smallest_max_batch():
    m = dict(SHAPE, results=rows({1: [1.1, 1.1], 2: [1.1, 1.0999]}))
    [e], _ = measure.choose([m])
    assert e["max_batch"] == 1  # 1.1 meets the 1.1x bar; 1.0999 does not
    # two measured shapes of one table key (other q_heads: another TP split of the same group)
    wide = dict(SHAPE, q_heads=64, kv_heads=16, results=rows({1: [2.0, 2.0], 2: [2.0, 2.0], 4: [2.0, 2.0], 8: [2.0, 2.0]}))
    narrow = dict(SHAPE, results=rows({1: [2.0, 2.0], 2: [2.0, 2.0], 4: [1.0, 1.0]}))
    for order in ([wide, narrow], [narrow, wide]):
        entries, shapes = measure.choose(order)
        assert [x["max_batch"] for x in entries] == [2] and len(shapes) == 2, entries


def test_one_prefix_is_not_enough():
    m = dict(SHAPE, results=rows({1: [3.0, 1.09], 2: [3.0, 1.0]}))
    entries, [rec] = measure.choose([m])
    assert entries == [] and rec["enabled"] is False and "batch 1" in rec["why"]


def test_a_missing_prefix_disagreeing_outputs_or_error_is_not_met():
    m = dict(SHAPE, results=rows({1: [1.5, 1.5]})[:1])          # 4096 not timed
    assert measure.choose([m], prefixes=[1024, 4096])[0] == []
    r = rows({1: [1.5, 1.5]})
    r[1]["agree"] = False
    assert measure.choose([dict(SHAPE, results=r)])[0] == []
    r = rows({1: [1.5, 1.5]})
    r[1] = {"batch": 1, "prefix": 4096, "error": "RuntimeError: capture failed"}
    assert measure.choose([dict(SHAPE, results=r)], prefixes=[1024, 4096])[0] == []
    assert measure.choose([dict(SHAPE, results=rows({1: [1.5, 1.5]}))], min_speedup=1.6)[0] == []


class Ctx:
    def __init__(self, answers):
        self.host = SimpleNamespace(sglang_port=None, sglang_host=None, sglang_api_key=None, server_user=None,
                                    unprivileged_user=None)
        self.container = None
        self.answers, self.calls = answers, []

    def probe(self, main, params, python=None, timeout=None):
        self.calls.append((main, params, python, timeout))
        a = self.answers[main]
        if isinstance(a, Exception):
            raise a
        return a


SERVER = {"pid": 42, "python": "/opt/py/bin/python3", "port": 30000, "host": "127.0.0.1"}
FACTS = {"python": {"path": "/opt/py/bin/python3"}, "servers": [SERVER]}
MODULE = "/var/lib/fleetctl-kernels/verify_attention/k1/build/verify_attention_cuda.so"
PKG = SimpleNamespace(name="verify_attention")


def bench_answer(**kw):
    return {"ok": True, "rc": 0, "timed_out": False, "answer": dict({
        "ok": True, "device": "cuda", "device_name": "NVIDIA H200 (cuda:0)", "graphs": True,
        "sglang": {"version": "0.5.23"}, "shapes": [dict(SHAPE, results=rows({1: [1.5, 1.2], 2: [1.3, 1.0]}))]},
        **kw)}


def info_answer():
    return {"servers": [{"pid": 42, "host": "127.0.0.1", "port": 30000, "server_info": dict(INFO, context_length=8192),
                         "config": LLAMA8B, "error": None}], "refused": []}


def test_measured_table():
    ctx = Ctx({"traffic.serverinfo": info_answer(), "kernel.dispatchbench": bench_answer()})
    t = measure.measured_table(ctx, "/opt/py/bin/python3", PKG, MODULE, "k1", "cuda", FACTS)
    assert t["schema"] == "fleetctl-dispatch/1" and t["source"] == "measured" and t["build"] == "k1"
    assert t["backend"] == "cuda" and t["all"] is False and t["route"] is None
    assert t["entries"] == [{"head_dim": 128, "group": 4, "draft_tokens": 4, "dtype": "bfloat16", "max_batch": 1,
                             "speedup": [1.5, 1.2]}]
    assert t["measured"]["prefixes"] == [1024, 4096] and t["measured"]["min_speedup"] == 1.1
    bench = ctx.calls[1][1]
    assert ctx.calls[1][0] == "kernel.dispatchbench" and ctx.calls[1][2] == "/opt/py/bin/python3"
    assert bench["src_dir"] == "/var/lib/fleetctl-kernels/verify_attention/k1/src"
    assert bench["request"]["module"] == MODULE and bench["request"]["device"] == "cuda"
    assert bench["request"]["shapes"][0]["batches"] == [1, 2, 4, 8] and bench["request"]["prefixes"] == [1024, 4096]
    assert ctx.calls[0][1]["servers"] == [{"pid": 42, "python": "/opt/py/bin/python3", "port": 30000,
                                           "host": "127.0.0.1"}]


@pytest.mark.parametrize("answers, said", [
    ({"traffic.serverinfo": ProbeFailed("boom")}, "not measured: ProbeFailed: boom"),
    ({"traffic.serverinfo": {"servers": [], "refused": []}}, "no shape to measure"),
    ({"kernel.dispatchbench": bench_answer(device="cpu", graphs=False)}, "only CUDA-graph timings"),
    ({"kernel.dispatchbench": bench_answer(graphs=False)}, "answered device 'cuda', graphs False: only CUDA-graph timings"),
    ({"kernel.dispatchbench": bench_answer(ok=False, error="RuntimeError: torch sees no CUDA device")}, "no CUDA device"),
    ({"kernel.dispatchbench": {"ok": False, "rc": -9, "timed_out": True, "answer": None}}, "timed out"),
])
def test_failures_give_source_none(answers, said):
    ctx = Ctx(dict({"traffic.serverinfo": info_answer(), "kernel.dispatchbench": bench_answer()}, **answers))
    t = measure.measured_table(ctx, "/p", PKG, MODULE, "k1", "cuda", FACTS)
    assert t["source"] == "none" and t["entries"] == [] and said in t["why"], t["why"]


def test_the_hosts_deadline_bounds_the_benchmark():
    ctx = Ctx({"traffic.serverinfo": info_answer(), "kernel.dispatchbench": bench_answer()})
    ctx.remaining = lambda: 500.0
    measure.measured_table(ctx, "/p", PKG, MODULE, "k1", "cuda", FACTS)
    assert ctx.calls[1][1]["request"]["deadline_s"] == 500.0 - measure.RESERVE_S - 2 * measure.BENCH_SLACK_S
    ctx = Ctx({"traffic.serverinfo": info_answer(), "kernel.dispatchbench": bench_answer()})
    ctx.remaining = lambda: 350.0
    t = measure.measured_table(ctx, "/p", PKG, MODULE, "k1", "cuda", FACTS)
    assert t["source"] == "none" and "350 s left" in t["why"] and len(ctx.calls) == 1


def test_why_is_one_line():
    ctx = Ctx({"traffic.serverinfo": ProbeFailed("probe failed on the host:\nTraceback\n  line 1")})
    t = measure.measured_table(ctx, "/p", PKG, MODULE, "k1", "cuda", FACTS)
    assert "\n" not in t["why"] and "Traceback line 1" in t["why"]


def test_no_servers():
    t = measure.measured_table(Ctx({}), "/p", PKG, MODULE, "k1", "cuda", {"servers": []})
    assert t["source"] == "none" and "no SGLang server" in t["why"]


def test_server_info_values_are_validated():
    got = serverinfo.pick_info({"tp_size": True, "dp_size": -1, "enable_dp_attention": 1, "page_size": 1 << 30,
                                "speculative_num_draft_tokens": 4, "dtype": "x" * 600})
    assert got["tp_size"] is None and got["dp_size"] is None and got["enable_dp_attention"] is None
    assert got["page_size"] is None and got["speculative_num_draft_tokens"] == 4 and got["dtype"] is None
    c = serverinfo.pick_config({"num_attention_heads": "32", "head_dim": 128, "text_config": {"hidden_size": 4096}})
    assert c["num_attention_heads"] is None and c["head_dim"] == 128 and c["text_config"]["hidden_size"] == 4096


def test_config_json_read_without_links_and_bounded(tmp_path):
    """Read as the server's uid (this test process stands for the server: runas.read_as; as root,
    tests/machine/test_runs_unprivileged.py), and said in fixed words: no path, error or value
    of the host's reaches the world-readable table (review R4-7)."""
    me = os.getpid()
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA8B))
    assert serverinfo.read_config(str(model), me) == (serverinfo.pick_config(LLAMA8B), None)
    unread = "config.json not readable as the server's uid (missing, a link on its path, or over 1 MiB)"
    link = tmp_path / "link"
    link.symlink_to(model)
    assert serverinfo.read_config(str(link), me) == (None, unread)
    other = tmp_path / "o"
    other.mkdir()
    (other / "config.json").symlink_to(model / "config.json")
    assert serverinfo.read_config(str(other), me) == (None, unread)
    (model / "config.json").write_text(" " * (serverinfo.MAX_CONFIG + 1))
    assert serverinfo.read_config(str(model), me) == (None, unread)
    assert "hub id" in serverinfo.read_config("meta-llama/Llama-3-8B", me)[1]
    assert "not an absolute local directory" in serverinfo.read_config(f"{model}/../m", me)[1]  # not normalised
    os.unlink(model / "config.json")
    (model / "config.json").write_text("[1]")
    assert serverinfo.read_config(str(model), me)[1] == "config.json is not a JSON object"
    (model / "config.json").write_text("[" * 60000)  # past the parser's depth: said, never raised
    assert serverinfo.read_config(str(model), me)[1] == "config.json is not JSON"
    assert str(tmp_path) not in str([serverinfo.read_config(str(p), me) for p in (model, link, other)])
