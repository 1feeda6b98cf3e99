"""kernels/verify_attention's SGLang-layout entry, `verify_attention_sglang`, on the CPU backend, fed
inputs that SGLang 0.5.23's own code builds (its EAGLE tree builder and kv-indices kernel, run
under the Triton interpreter by sglang_target_verify.py), against the float64 reference; the
package's own builder (sglang_layout.py, which test_kernel.py and bench/gpu_check use) against
SGLang's; a hand-checked draft tree; and the entry's input checks.

The CUDA backend's entry is compiled by test_verify_attention.py (nvcc for sm_90 and sm_120, the
binding against torch's headers) and checked numerically on a GPU by test_kernel.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fleetctl.engine.kernels.package import load_package

ROOT = Path(__file__).resolve().parents[2]
PKG = load_package(ROOT / "kernels", "verify_attention")
sys.path.insert(0, str(PKG.root))
import test_kernel  # noqa: E402
from reference import tree_mask_from_parents, verify_attention_ref  # noqa: E402
from sglang_layout import target_verify_args  # noqa: E402

BUILDER = Path(__file__).resolve().parent / "sglang_target_verify.py"
# (T, topk, steps): SGLang's auto draft shapes (speculative_hook.py:1430-1461: (3, 1, 4) for most
# models, (5, 4, 8) for Llama), one draft token, and a topk-2 tree at T 4
TREES = [(1, 1, 1), (4, 1, 3), (4, 2, 3), (8, 4, 5)]
# each request's prefix: the first one's P, the second a ragged partner (0 and 1 included)
PREFIXES = {0: [0, 1], 1: [1, 0], 4097: [4097, 37]}
HAND = {"B": 1, "T": 4, "topk": 2, "steps": 2, "prefix_lens": [3], "fill_prefix_mask": True, "seed": 1,
        "draft_probs": [[[0.6, 0.4]], [[0.5, 0.3], [0.9, 0.05]]]}
CASES = [{"B": 2, "T": T, "topk": k, "steps": s, "prefix_lens": PREFIXES[P], "fill_prefix_mask": i % 2 == 0,
          "seed": 100 + i} for i, ((T, k, s), P) in enumerate((t, p) for t in TREES for p in PREFIXES)]
HKV = 2  # several KV heads and a group > 1: a query head reading the wrong KV head shows


@pytest.fixture(scope="module")
def sglang_built(tmp_path_factory):
    """{"wheel", "cases": [HAND] + CASES, each with SGLang's tensors} from one builder run."""
    tmp = tmp_path_factory.mktemp("sglang_tv")
    (tmp / "cases.json").write_text(json.dumps([HAND] + CASES))
    r = subprocess.run([sys.executable, str(BUILDER), str(tmp / "cases.json"), str(tmp / "out.pt")],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, TRITON_INTERPRET="1"))
    if r.returncode == 3:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(tmp / "out.pt", weights_only=False)


@pytest.fixture(scope="module")
def cpu_mod(cpu_kernel):
    return test_kernel.load_module(cpu_kernel[3]["module_path"])


def tree_bits(c: dict) -> torch.Tensor:
    """[B, T, T] tree bits read out of SGLang's FULL_MASK at mask_indptr[b] + i*(P_b+T) + P_b + j."""
    T = c["T"]
    out = []
    for b, P in enumerate(c["prefix_lens"]):
        rows = c["custom_mask"][int(c["mask_indptr"][b]):int(c["mask_indptr"][b + 1])].view(T, P + T)
        out.append(rows[:, P:].bool())
    return torch.stack(out)


def test_sglang_builds_the_hand_checked_tree(sglang_built):
    """Draft probabilities 0.6/0.4, then 0.5/0.3 under the first and 0.9/0.05 under the second token:
    scores 0.6, 0.4, 0.30, 0.18, 0.36, 0.02, so the top 3 are candidates 0, 1 and 4 (0.36 = child 0
    of candidate 1): tree 0 -> {1, 2}, 2 -> 3. FULL_MASK rows are the 3 prefix columns, then the tree."""
    c = sglang_built["cases"][0]
    assert c["top_scores_index"].tolist() == [[0, 1, 4]] and c["parent_list"].tolist() == [[-1, 0, 1]]
    assert c["parents"] == [[-1, 0, 0, 2]]
    want = torch.tensor([[1, 1, 1, 1, 0, 0, 0],
                         [1, 1, 1, 1, 1, 0, 0],
                         [1, 1, 1, 1, 0, 1, 0],
                         [1, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    assert c["custom_mask"].dtype == torch.bool and torch.equal(c["custom_mask"].view(4, 7), want)
    assert c["mask_indptr"].tolist() == [0, 28] and c["mask_indptr"].dtype == torch.int64
    assert c["kv_indptr"].tolist() == [0, 3] and c["kv_indptr"].dtype == torch.int32
    assert c["qo_indptr"].tolist() == [0, 4] and c["kv_indices"].dtype == torch.int64


def test_sglang_trees_are_the_drafted_trees(sglang_built):
    """Read at the entry's documented offset, SGLang's mask holds exactly the tree the draft made
    (parents tracked while drafting); with the prefix filled, every prefix column is True."""
    for c in sglang_built["cases"][1:]:
        want = torch.stack([tree_mask_from_parents(p) for p in c["parents"]])
        assert torch.equal(tree_bits(c), want), c["parents"]
        if c["fill_prefix_mask"]:
            for b, P in enumerate(c["prefix_lens"]):
                rows = c["custom_mask"][int(c["mask_indptr"][b]):int(c["mask_indptr"][b + 1])].view(c["T"], -1)
                assert rows[:, :P].all()
    assert {tuple(p) for c in sglang_built["cases"] if c["T"] == 8 for p in c["parents"]} - {
        tuple(range(-1, 7))}, "the topk-4 drafts should include real trees, not only chains"


def reference_inputs(c: dict, Hq: int, D: int, dtype: torch.dtype, seed: int):
    """Random q/K/V for SGLang case c: (SGLang-layout kwargs of the entry, reference-layout inputs).

    The draft tokens' K/V are k_extend/v_extend; for the reference they are appended to the pool
    after its slots, and request b's req_to_token row lists its prefix (SGLang's kv_indices) and
    then those draft slots."""
    gen = torch.Generator().manual_seed(seed)
    B, T = c["B"], c["T"]
    num_slots = c["req_to_token"].max().item() + 1

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q, kb, vb, ke, ve = randn(B * T, Hq, D), randn(num_slots, HKV, D), randn(num_slots, HKV, D), \
        randn(B * T, HKV, D), randn(B * T, HKV, D)
    plens = c["prefix_lens"]
    r2t = torch.zeros(B, max(plens) + T, dtype=torch.int64)
    for b, P in enumerate(plens):
        r2t[b, :P] = c["kv_indices"][int(c["kv_indptr"][b]):int(c["kv_indptr"][b + 1])]
        r2t[b, P:P + T] = num_slots + b * T + torch.arange(T)
    ref = dict(q=q, k_cache=torch.cat([kb, ke]), v_cache=torch.cat([vb, ve]), req_to_token=r2t,
               req_pool_indices=torch.arange(B), prefix_lens=torch.tensor(plens),
               tree_mask=torch.stack([tree_mask_from_parents(p) for p in c["parents"]]), sm_scale=D ** -0.5)
    entry = dict(q=q, k_extend=ke, v_extend=ve, k_buffer=kb, v_buffer=vb, qo_indptr=c["qo_indptr"],
                 kv_indptr=c["kv_indptr"], kv_indices=c["kv_indices"], mask_indptr=c["mask_indptr"], T=T,
                 sm_scale=D ** -0.5)
    return entry, ref


def graph_buffer(c: dict) -> torch.Tensor:
    """SGLang's CUDA-graph mask: a longer uint8 buffer, custom_mask copied to its start
    (triton_backend.py:634-640), stale entries after it, and here the prefix columns overwritten
    with 0/1 garbage, as fill_prefix_mask=False leaves them (eagle_utils.py:170-171)."""
    buf = torch.ones(c["custom_mask"].numel() + c["T"] ** 2 + 13, dtype=torch.uint8)
    buf[:c["custom_mask"].numel()] = c["custom_mask"].to(torch.uint8)
    for b, P in enumerate(c["prefix_lens"]):
        rows = buf[int(c["mask_indptr"][b]):int(c["mask_indptr"][b + 1])].view(c["T"], -1)
        rows[:, :P] = (torch.arange(P) % 2).to(torch.uint8)
    return buf


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("G, D", [(1, 64), (8, 64), (1, 128), (8, 128)])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"T{c['T']}-topk{c['topk']}-P{c['prefix_lens'][0]}"
                                                          for c in CASES])
def test_cpu_entry_on_sglang_built_inputs_matches_reference(sglang_built, cpu_mod, case, G, D, dtype):
    """SGLang's eager bool mask, its uint8 graph buffer (prefix columns garbage) and, for chains,
    custom_mask None: each writes every row of o in place, within kernel.yaml's tolerance."""
    c = sglang_built["cases"][1 + case]
    atol, rtol = PKG.tolerances[dtype]
    entry, ref = reference_inputs(c, HKV * G, D, getattr(torch, dtype), seed=case * 31 + G * 7 + D)
    want = verify_attention_ref(**ref)
    masks = {"bool": c["custom_mask"], "uint8 graph buffer": graph_buffer(c)}
    if all(p == list(range(-1, c["T"] - 1)) for p in c["parents"]):
        masks["None (chain)"] = None
    for name, mask in masks.items():
        o = torch.full_like(entry["q"], float("nan"))    # a row the entry does not write stays NaN
        assert cpu_mod.verify_attention_sglang(**entry, o=o, custom_mask=mask) is None
        torch.testing.assert_close(o.double(), want, atol=atol, rtol=rtol, msg=lambda m: f"mask {name}: {m}")


def test_package_builder_is_sglangs(sglang_built):
    """sglang_layout.target_verify_args, given the reference layout of SGLang's own case, builds the
    same qo_indptr, kv_indptr, kv_indices, mask_indptr (values and dtypes) and tree bits."""
    for c in sglang_built["cases"]:
        _, ref = reference_inputs(c, 2, 64, torch.float32, seed=0)
        a = target_verify_args(ref, "bool")
        for k in ("qo_indptr", "kv_indptr", "kv_indices", "mask_indptr"):
            assert a[k].dtype == c[k].dtype and torch.equal(a[k], c[k]), k
        assert a["custom_mask"].dtype == torch.bool
        assert torch.equal(tree_bits(dict(c, custom_mask=a["custom_mask"])), tree_bits(c))
        if c["fill_prefix_mask"]:
            assert torch.equal(a["custom_mask"], c["custom_mask"])


def test_o_may_be_a_strided_view(cpu_mod):
    """SGLang passes o.view(-1, Hq, D) of its output buffer; the entry writes through o's strides."""
    gen = torch.Generator().manual_seed(9)
    x = test_kernel.make_inputs(2, 4, [5, 0], 2, 4, 64, torch.float32, "cpu", gen)
    a = target_verify_args(x, "bool")
    big = torch.zeros(8, 8, 2 * 64)
    a["o"] = big[:, :, 64:]                      # head stride 128, token stride 1024
    cpu_mod.verify_attention_sglang(**a)
    torch.testing.assert_close(a["o"].double(), verify_attention_ref(**x), atol=2e-5, rtol=1e-4)
    assert torch.equal(big[:, :, :64], torch.zeros(8, 8, 64))


def test_cpu_entry_rejects_bad_inputs(cpu_mod):
    gen = torch.Generator().manual_seed(4)
    x = test_kernel.make_inputs(2, 4, [10, 3], 1, 2, 64, torch.float32, "cpu", gen)
    a = target_verify_args(x, "uint8")
    bad = {
        "a prefix slot id of request 0 is outside k_buffer": dict(a, kv_indices=a["kv_indices"] + 1000),
        "mask_indptr: request 1 needs": dict(a, custom_mask=a["custom_mask"][:60]),
        r"qo_indptr\[1\] = 3, expected 4": dict(a, qo_indptr=torch.tensor([0, 3, 8], dtype=torch.int32)),
        "o must have q's shape": dict(a, o=a["o"][:-1]),
        "k_extend must have B\\*T rows": dict(a, k_extend=a["k_extend"][:-1], v_extend=a["v_extend"][:-1]),
        "kv_indices must be 1-D int64": dict(a, kv_indices=a["kv_indices"].int()),
        "custom_mask must be 1-D bool/uint8": dict(a, custom_mask=a["custom_mask"][:64].view(8, 8)),
        "kv_indptr\\[B\\] = 13 exceeds kv_indices' length 12": dict(a, kv_indices=a["kv_indices"][:12]),
        "dtypes differ": dict(a, k_extend=a["k_extend"].half()),
    }
    for msg, args in bad.items():
        with pytest.raises(RuntimeError, match=msg):
            cpu_mod.verify_attention_sglang(**args)
