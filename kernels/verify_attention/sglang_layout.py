"""SGLang's target-verify inputs (page size 1) built from the package's own layout (reference.py), for
the backends' `verify_attention_sglang` entry, as SGLang's TritonAttnBackend builds them.

`target_verify_args(x)` turns reference-layout inputs x (q, k_cache, v_cache, req_to_token,
req_pool_indices, prefix_lens, tree_mask, sm_scale) into the entry's keyword arguments:

  q            [B*T, Hq, D]      x["q"] itself
  k_extend,    [B*T, Hkv, D]     the draft tokens' K/V, contiguous (SGLang passes `k.contiguous()`, the
  v_extend                       tokens it has just written to the pool: 0.5.23 triton_backend.py:1891-1892)
  o            [B*T, Hq, D]      filled with NaN, so a row the entry does not write shows
  k_buffer,    [num_slots, Hkv, D]  x["k_cache"], x["v_cache"] (token_to_kv_pool.get_key_buffer)
  v_buffer
  qo_indptr    [B+1] = b*T       arange(0, (1+bs)*T, T) int32: 0.5.23 triton_backend.py:1010-1016 (eager),
                                 :601-607 into the int64 graph buffer of :397-401; 0.5.10 :306-312, :568-575
  kv_indptr    [B+1] int32       [0, cumsum(seq_lens)] with seq_lens the prefix lengths (drafts excluded):
                                 0.5.23 :526 into the int32 buffer of :381-383; 0.5.10 :314, buffer :152-154
  kv_indices   int64             each request's prefix slots req_to_token[req_pool_indices[b], :seq_lens[b]],
                                 back to back (create_flashinfer_kv_indices_triton, 0.5.23
                                 kernels/ops/attention/kv_indices.py:59-137, called triton_backend.py:1021-1031
                                 via kv_index_translator.py:603; 0.5.10 triton_backend.py:316-327)
  custom_mask  1-D bool/uint8    FULL_MASK, per request T rows of P_b + T columns, requests back to back;
               or None           the tree bits in the last T columns (kernels/ops/speculative/spec_tree.py:
                                 143-169), the prefix columns True only when filled
                                 (srt/speculative/eagle_utils.py:166-171, 189-199).
                                 Eager: spec_info.custom_mask, bool (triton_backend.py:1051); under CUDA
                                 graphs a larger uint8 buffer holding it at its start (:634-640, :1237-1246;
                                 0.5.10 :479-483, :606-607). None (no spec mask): causal over the drafts,
                                 as extend_attention_fwd without a mask (extend_attention.py:1017).
  mask_indptr  [B+1] int64       [0, cumsum(T * (seq_lens + T))]: 0.5.23 :1052-1057 (buffer :404-406), :641-643;
                                 0.5.10 :349-353
  T            int               draft tokens per request (max_extend_len, :1058)
  sm_scale     float             layer.scaling

so that the tree bit (i, j) of request b is custom_mask[mask_indptr[b] + i*(P_b+T) + P_b + j], the read
extend_attention_fwd does (0.5.23 extend_attention.py:740-747; 0.5.10 triton_ops/extend_attention.py:437-443).
"""

from __future__ import annotations

import torch

MASKS = ("bool", "uint8", None)


def target_verify_args(x: dict, mask: str | None = "bool", prefix_columns: str = "true") -> dict:
    """The entry's keyword arguments for reference-layout inputs `x` (see the module docstring).

    mask: "bool" (eager), "uint8" (the CUDA-graph buffer: the mask copied into the start of a longer
    uint8 buffer whose tail holds 1s), or None (every tree must then be the causal chain).
    prefix_columns: "true" (SGLang's fill) or "garbage" (fill_prefix_mask=False, eagle_utils.py:170-171, 195-199:
    the prefix columns are left as they were; here 0 and 1 alternating, so a kernel that reads them
    sees prefix keys vanish).
    Raises ValueError for mask None with a non-chain tree, or an unknown mask / prefix_columns.
    """
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}, got {mask!r}")
    if prefix_columns not in ("true", "garbage"):
        raise ValueError(f"prefix_columns must be 'true' or 'garbage', got {prefix_columns!r}")
    q = x["q"]
    dev = q.device
    B = x["req_pool_indices"].numel()
    T = x["tree_mask"].shape[-1]
    trees = x["tree_mask"].expand(B, T, T) if x["tree_mask"].dim() == 2 else x["tree_mask"]
    if mask is None and not torch.equal(trees.bool().cpu(), torch.ones(B, T, T, dtype=torch.bool).tril()):
        raise ValueError("custom_mask None means a causal chain: every tree must be the lower triangle")
    plens = [int(p) for p in x["prefix_lens"].tolist()]
    rows = [int(r) for r in x["req_pool_indices"].tolist()]
    r2t = x["req_to_token"]
    prefix = [r2t[rows[b], :plens[b]].long() for b in range(B)]
    draft = torch.cat([r2t[rows[b], plens[b]:plens[b] + T].long() for b in range(B)])
    seq_lens = torch.tensor(plens, dtype=torch.int64, device=dev)
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(seq_lens, dim=0)
    mask_indptr = torch.zeros(B + 1, dtype=torch.int64, device=dev)
    mask_indptr[1:] = torch.cumsum(T * (seq_lens + T), dim=0)
    custom_mask = None
    if mask is not None:
        parts = []
        for b in range(B):
            m = torch.ones(T, plens[b] + T, dtype=torch.uint8, device=dev)
            if prefix_columns == "garbage":
                m[:, :plens[b]] = (torch.arange(plens[b], device=dev) % 2).to(torch.uint8)
            m[:, plens[b]:] = trees[b].to(torch.uint8)
            parts.append(m.flatten())
        custom_mask = torch.cat(parts)
        if mask == "bool":
            custom_mask = custom_mask.view(torch.bool)
        else:
            custom_mask = torch.cat([custom_mask, torch.ones(T * T + 17, dtype=torch.uint8, device=dev)])
    return {
        "q": q,
        "k_extend": x["k_cache"][draft].contiguous(),
        "v_extend": x["v_cache"][draft].contiguous(),
        "o": torch.full_like(q, float("nan")),
        "k_buffer": x["k_cache"],
        "v_buffer": x["v_cache"],
        "qo_indptr": torch.arange(0, (1 + B) * T, step=T, dtype=torch.int32, device=dev),
        "kv_indptr": kv_indptr,
        "kv_indices": torch.cat(prefix) if sum(plens) else torch.empty(0, dtype=torch.int64, device=dev),
        "custom_mask": custom_mask,
        "mask_indptr": mask_indptr,
        "T": T,
        "sm_scale": x["sm_scale"],
    }


def reference_args(a: dict, tree_mask) -> dict:
    """Reference-layout inputs (reference.py) for the entry's SGLang-layout arguments `a` and the
    [T, T] or [B, T, T] tree they encode: the draft tokens' K/V appended to the pool after its slots,
    request b's req_to_token row its prefix slots (kv_indices) and then those draft slots. Reads the
    index tensors on the host (for checks, never on a timed path)."""
    T = a["T"]
    kv_indptr = a["kv_indptr"].tolist()
    B = len(kv_indptr) - 1
    num_slots = a["k_buffer"].shape[0]
    dev = a["q"].device
    plens = [kv_indptr[b + 1] - kv_indptr[b] for b in range(B)]
    r2t = torch.zeros(B, max(plens, default=0) + T, dtype=torch.int64, device=dev)
    for b, P in enumerate(plens):
        r2t[b, :P] = a["kv_indices"][kv_indptr[b]:kv_indptr[b + 1]]
        r2t[b, P:P + T] = num_slots + b * T + torch.arange(T, device=dev)
    return dict(q=a["q"], k_cache=torch.cat([a["k_buffer"], a["k_extend"]]),
                v_cache=torch.cat([a["v_buffer"], a["v_extend"]]), req_to_token=r2t,
                req_pool_indices=torch.arange(B, device=dev), prefix_lens=torch.tensor(plens, device=dev),
                tree_mask=tree_mask, sm_scale=a["sm_scale"])
