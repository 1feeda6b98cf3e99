"""SGLang 0.5.23's own target-verify input builders, run on this CPU: the draft tree, its FULL_MASK,
kv_indptr / kv_indices / qo_indptr / mask_indptr, as the Triton attention backend gets them.

    TRITON_INTERPRET=1 python3 tests/machine/sglang_target_verify.py CASES.json OUT.pt

(TRITON_INTERPRET must be set before triton is imported, hence a process of its own.) CASES.json is
a list of {"B", "T", "topk", "steps", "prefix_lens", "fill_prefix_mask", "seed"} (and optionally
"draft_probs", see draft()); OUT.pt (torch.save)
the same list, each case with "req_to_token", "req_pool_indices", "seq_lens", the SGLang tensors
"qo_indptr", "kv_indptr", "kv_indices", "custom_mask", "mask_indptr", and "parents" ([B][T] parent
draft positions, -1 for the root, tracked while the draft is simulated: not read back from SGLang's
tree, so a test can check SGLang's mask against it).

The functions run are the wheel's own source (fleetctl.wheels.find_wheel("0.5.23")), copied out of it
into a temporary module and imported from there, decorators aside:
  srt/speculative/spec_utils.py        _select_top_k_tokens_first, _select_top_k_tokens_later
                                       (the EAGLE draft's per-step top-k and tree bookkeeping, :417-471;
                                       its @torch.compile dropped, fast_topk taken as torch.topk)
  srt/speculative/eagle_utils.py       organize_draft_results (:98-125), build_tree_kernel_efficient
                                       (:138-231, the FULL_MASK allocation and fill)
  kernels/ops/speculative/spec_tree.py TreeMaskMode, sgl_build_tree_kernel_efficient_triton and its
                                       launcher sgl_build_tree_kernel_triton (:52-200, :320-364: the
                                       Triton build of the tree SGLang runs on XPU, spec_tree.py:396-410;
                                       on CUDA the same algorithm is the JIT kernel in
                                       kernels/jit/csrc/speculative/tree.cuh)
  kernels/ops/attention/kv_indices.py  the whole file (it imports only triton):
                                       create_flashinfer_kv_indices_triton, as pack_read_stream launches it
                                       for page size 1 (srt/mem_cache/kv_index_translator.py:603-613)
What is not SGLang's code here is the glue of TritonAttnBackend.init_forward_metadata's target-verify
branch (srt/layers/attention/triton_backend.py:1008-1058), a method of a backend that needs a model
runner, followed line by line below, and the draft model, replaced by random top-k probabilities.
The interpreter needs bench/gpu_check/interp_shims.py (numpy >= 2.4 refuses int() of a 1-element
array, which Triton's interpreter does for a loop bound loaded with tl.load).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PIECES = {  # in definition order: eagle_utils' defaults name TreeMaskMode
    "sglang/kernels/ops/speculative/spec_tree.py": ["TreeMaskMode", "sgl_build_tree_kernel_efficient_triton",
                                                    "sgl_build_tree_kernel_triton"],
    "sglang/srt/speculative/spec_utils.py": ["_select_top_k_tokens_first", "_select_top_k_tokens_later"],
    "sglang/srt/speculative/eagle_utils.py": ["organize_draft_results", "build_tree_kernel_efficient"],
}
WHOLE = "sglang/kernels/ops/attention/kv_indices.py"
HEADER = '''# Copied from {wheel} by tests/machine/sglang_target_verify.py (definitions only).
from enum import IntEnum
from typing import List, Optional
import torch
import triton
import triton.language as tl

_is_npu = _is_xpu = False
def fast_topk(values, topk, dim):  # sglang.srt.utils.fast_topk, for the k > 1 it is called with here
    return torch.topk(values, topk, dim=dim)
def maybe_detect_oob(*args, **kwargs):  # a debug check (SGLANG_DEBUG...): off by default
    pass
'''


def extract(source: str, names: list[str]) -> str:
    """The named top-level definitions of `source` (decorators kept, except torch.compile)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    found, out = set(), []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            keep = [d for d in node.decorator_list if "torch.compile" not in ast.unparse(d)]
            start = min([d.lineno for d in keep] + [node.lineno])
            out.append("\n".join(lines[start - 1:node.end_lineno]))
            found.add(node.name)
    if found != set(names):
        raise LookupError(f"not found in the wheel's source: {sorted(set(names) - found)}")
    return "\n\n\n".join(out)


def load_sglang(wheel: Path, workdir: Path):
    """Write the pieces of the wheel into workdir and import them: (module, kv_indices module)."""
    with zipfile.ZipFile(wheel) as z:
        parts = [extract(z.read(path).decode(), names) for path, names in PIECES.items()]
        (workdir / "sgl_kv_indices.py").write_bytes(z.read(WHOLE))
    (workdir / "sgl_pieces.py").write_text(HEADER.format(wheel=wheel.name) + "\n\n" + "\n\n\n".join(parts) + "\n\n"
                                           "build_tree_kernel_efficient_func = sgl_build_tree_kernel_triton\n")
    mods = []
    for name in ("sgl_pieces", "sgl_kv_indices"):
        spec = importlib.util.spec_from_file_location(name, workdir / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods


def draft(sgl, B: int, T: int, topk: int, steps: int, gen, probs=None):
    """An EAGLE draft as eagle_worker_v2.draft_forward runs it (:801-818): `steps` calls of
    select_top_k_tokens with the draft model's top-k replaced by random probabilities, then
    organize_draft_results. probs (optional, for a hand-checked case): per step the draft model's
    top-k probabilities, [B, topk] for the first step and [B * topk, topk] after. Returns
    (parent_list, top_scores_index, draft_tokens, parents) where parents[b][i] is the draft position
    of token i's parent, from this function's own bookkeeping."""
    import torch

    scores, hidden = None, None
    score_list, token_list, parents_list = [], [], []
    origin = []                       # per step: [B, topk] global candidate index of each selected token
    cand_parent = [[] for _ in range(B)]   # global candidate index -> parent's global index (-1 root)
    def step_probs(i, rows):
        if probs is not None:
            return torch.tensor(probs[i], dtype=torch.float32)
        return torch.rand(rows, topk, generator=gen).sort(dim=1, descending=True).values

    topk_p = step_probs(0, B)
    topk_index = torch.randint(0, 32000, (B, topk), generator=gen)
    for i in range(steps):
        if i == 0:
            _, hidden, scores, info = sgl._select_top_k_tokens_first(topk_p, topk_index, hidden, topk)
            for b in range(B):
                cand_parent[b] += [-1] * topk
            origin.append(torch.arange(topk).expand(B, topk))
        else:
            _, hidden, scores, info = sgl._select_top_k_tokens_later(i, topk_p, topk_index, hidden, scores, topk)
            for b in range(B):                     # candidate r*topk + c is child c of selected token r
                cand_parent[b] += [int(origin[-1][b, r]) for r in range(topk) for _ in range(topk)]
            origin.append(info[2])
        score_list.append(info[0])
        token_list.append(info[1])
        parents_list.append(info[2])
        if i == steps - 1:
            break
        topk_p = step_probs(i + 1, B * topk)
        topk_index = torch.randint(0, 32000, (B * topk, topk), generator=gen)
    parent_list, top_scores_index, draft_tokens = sgl.organize_draft_results(score_list, token_list, parents_list, T)
    parents = []
    for b in range(B):     # a child's score is its parent's times a probability < 1: its parent is drafted too
        pos = {int(c): i + 1 for i, c in enumerate(top_scores_index[b].tolist())}
        parents.append([-1] + [0 if cand_parent[b][c] == -1 else pos[cand_parent[b][c]]
                               for c in top_scores_index[b].tolist()])
    return parent_list, top_scores_index, draft_tokens, parents


def build_case(sgl, kvi, case: dict) -> dict:
    """One case's SGLang inputs (see the module docstring)."""
    import torch

    gen = torch.Generator().manual_seed(case["seed"])
    B, T, topk, steps = case["B"], case["T"], case["topk"], case["steps"]
    plens = case["prefix_lens"]
    num_slots = sum(plens) + B * T + 5
    slots = torch.randperm(num_slots, generator=gen)
    max_reqs, max_ctx = B + 3, max(plens) + T + 4
    req_to_token = torch.zeros(max_reqs, max_ctx, dtype=torch.int32)
    rows = torch.randperm(max_reqs, generator=gen)[:B]
    start = 0
    for b, p in enumerate(plens):
        req_to_token[rows[b], :p + T] = slots[start:start + p + T].to(torch.int32)
        start += p + T
    seq_lens = torch.tensor(plens, dtype=torch.int64)
    parent_list, top_scores_index, draft_tokens, parents = draft(sgl, B, T, topk, steps, gen, case.get("draft_probs"))
    bonus = torch.randint(0, 32000, (B,), generator=gen)
    tree_mask = sgl.build_tree_kernel_efficient(bonus, parent_list, top_scores_index, draft_tokens, seq_lens,
                                                int(seq_lens.sum()), topk, steps, T, sgl.TreeMaskMode.FULL_MASK,
                                                fill_prefix_mask=case["fill_prefix_mask"])[0]
    # TritonAttnBackend.init_forward_metadata, forward_mode.is_target_verify() (triton_backend.py:1008-1058)
    qo_indptr = torch.arange(0, (1 + B) * T, step=T, dtype=torch.int32)                      # :1010-1016
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32)                                        # buffer :381-383
    kv_indices = torch.empty(int(seq_lens.sum()), dtype=torch.int64)                        # :1021-1023
    kv_indptr[1:] = torch.cumsum(seq_lens, dim=0)                                            # :526
    kvi.create_flashinfer_kv_indices_triton[(B, 1)](req_to_token, rows, seq_lens, kv_indptr, None, kv_indices,
                                                   req_to_token.stride(0), ENTRY_PAGE_SIZE=1,
                                                   TOKEN_BLOCK_PARALLEL=False)               # :603-613
    mask_indptr = torch.zeros(B + 1, dtype=torch.int64)                                      # buffer :404-406
    mask_indptr[1:B + 1] = torch.cumsum(T * (seq_lens + T), dim=0)                           # :1052-1057
    return dict(case, req_to_token=req_to_token, req_pool_indices=rows, seq_lens=seq_lens, qo_indptr=qo_indptr,
                kv_indptr=kv_indptr, kv_indices=kv_indices, custom_mask=tree_mask, mask_indptr=mask_indptr,
                parents=parents, parent_list=parent_list, top_scores_index=top_scores_index)


def main(argv: list[str]) -> int:
    import torch

    sys.path.insert(0, str(ROOT / "agent"))
    sys.path.insert(0, str(ROOT / "bench" / "gpu_check"))
    from fleetctl.wheels import find_wheel

    import interp_shims

    wheel = find_wheel("0.5.23")
    if wheel is None:
        print("the SGLang 0.5.23 wheel is not in the wheel cache (scripts/setup.sh downloads it)", file=sys.stderr)
        return 3
    interp_shims.apply()
    cases = json.loads(Path(argv[0]).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        sgl, kvi = load_sglang(wheel, Path(tmp))
        out = [build_case(sgl, kvi, c) for c in cases]
    torch.save({"wheel": wheel.name, "cases": out}, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
