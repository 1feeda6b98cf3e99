"""The two baselines of the GPU check, called on the kernel's own inputs (kernels/verify_attention/reference.py
layout: q [B*T, Hq, D], k_cache/v_cache [num_slots, Hkv, D], req_to_token [max_reqs, max_ctx],
req_pool_indices [B], prefix_lens [B], tree_mask [T, T] or [B, T, T]).

1. SGLang's own Triton path for target-verify on NVIDIA: `extend_attention_fwd` of the 0.5.23 wheel
   (carried/extend_attention.py), called as that release's TritonAttnBackend calls it
   (sglang/srt/layers/attention/triton_backend.py):
     init_forward_metadata, forward_mode.is_target_verify():
       qo_indptr   = arange(0, (1 + bs) * T, T), int32                 (T = num_tokens_per_req)
       kv_indptr   = [0, cumsum(seq_lens)], int32 buffer               (seq_lens: prefix, drafts excluded)
       kv_indices  = the prefix slots of each request, int64, back to back
       custom_mask = spec_info.custom_mask, bool: per request T rows x (seq_len + T) columns, row-major,
                     requests back to back (eagle_utils.build_tree_kernel_efficient, FULL_MASK: prefix
                     columns filled True, the last T columns the tree)
       mask_indptr = [0, cumsum(T * (seq_lens + T))], int64 buffer
       max_extend_len = T
     forward_extend -> _forward_extend_kernel -> extend_attention_fwd(
       q.view(-1, Hq, D), k.contiguous(), v.contiguous(), o.view(-1, Hq, D), k_buffer, v_buffer,
       qo_indptr, kv_indptr, kv_indices, custom_mask, causal=True, mask_indptr, max_extend_len,
       k_descale=1.0, v_descale=1.0, layer.scaling, logit_cap=0 (no capping), sliding_window_size=-1,
       sinks=None, window_kv_offsets=None, xai_temperature_len=-1, page_size=1, score_mod=None,
       aux_tensors=None, extend_seq_lens_cpu=...)
   where k, v are the draft tokens' own K/V ([B*T, Hkv, D], already written to the pool too) and
   skip_prefix_custom_mask keeps its default True (every draft token sees the whole prefix). The
   split-KV verify paths of that file (verify_splitkv_fwd, verify_shared_kv_fwd) are gfx95-only, so
   on NVIDIA target-verify always reaches extend_attention_fwd. extend_seq_lens_cpu only feeds the
   HIP compact grid; it is passed as None.
2. Gather + torch scaled_dot_product_attention (as kernels/verify_attention/bench.py): K/V gathered by
   req_to_token, the [B, 1, T, P + T] mask built outside the timed call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sglang_target_verify_metadata(x: dict) -> dict:
    """SGLang's target-verify metadata and draft-token K/V for the kernel's inputs `x`.

    Returns {qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, max_len_extend, slots_prefix,
    slots_draft}; slots_* are the per-request slot rows used to gather k_extend/v_extend from a cache.
    Built with host loops (setup, never timed); all tensors on q's device.
    """
    q = x["q"]
    dev = q.device
    B = x["req_pool_indices"].numel()
    T = x["tree_mask"].shape[-1]
    masks = x["tree_mask"].expand(B, T, T) if x["tree_mask"].dim() == 2 else x["tree_mask"]
    plens = [int(p) for p in x["prefix_lens"].tolist()]
    rows = [int(r) for r in x["req_pool_indices"].tolist()]
    r2t = x["req_to_token"]
    prefix = [r2t[rows[b], :plens[b]].long() for b in range(B)]
    draft = [r2t[rows[b], plens[b]:plens[b] + T].long() for b in range(B)]
    custom = []
    for b in range(B):
        m = torch.ones(T, plens[b] + T, dtype=torch.bool, device=dev)
        m[:, plens[b]:] = masks[b].bool()
        custom.append(m.flatten())
    seq_lens = torch.tensor(plens, dtype=torch.int64, device=dev)
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(seq_lens, dim=0)
    mask_indptr = torch.zeros(B + 1, dtype=torch.int64, device=dev)
    mask_indptr[1:] = torch.cumsum(T * (seq_lens + T), dim=0)
    return {
        "qo_indptr": torch.arange(0, (1 + B) * T, step=T, dtype=torch.int32, device=dev),
        "kv_indptr": kv_indptr,
        "kv_indices": torch.cat(prefix) if sum(plens) else torch.empty(0, dtype=torch.int64, device=dev),
        "custom_mask": torch.cat(custom),
        "mask_indptr": mask_indptr,
        "max_len_extend": T,
        "slots_draft": torch.cat(draft),
    }


def triton_target_verify(extend_attention_fwd, x: dict, meta: dict, k_cache=None, v_cache=None,
                         k_extend=None, v_extend=None) -> torch.Tensor:
    """One target-verify attention call through SGLang's extend_attention_fwd; returns [B*T, Hq, D].

    k_cache/v_cache default to x's; k_extend/v_extend (the draft tokens' K/V, [B*T, Hkv, D]
    contiguous) default to a gather of meta["slots_draft"] from that cache (pass them to keep the
    gather out of a timed region).
    """
    k_cache = x["k_cache"] if k_cache is None else k_cache
    v_cache = x["v_cache"] if v_cache is None else v_cache
    if k_extend is None:
        k_extend = k_cache[meta["slots_draft"]].contiguous()
        v_extend = v_cache[meta["slots_draft"]].contiguous()
    q = x["q"]
    o = torch.empty_like(q)
    extend_attention_fwd(
        q.view(-1, q.shape[1], q.shape[2]),
        k_extend,
        v_extend,
        o.view(-1, q.shape[1], q.shape[2]),
        k_cache,
        v_cache,
        meta["qo_indptr"],
        meta["kv_indptr"],
        meta["kv_indices"],
        meta["custom_mask"],
        True,
        meta["mask_indptr"],
        meta["max_len_extend"],
        1.0,
        1.0,
        x["sm_scale"],
        logit_cap=0.0,
        sliding_window_size=-1,
        sinks=None,
        window_kv_offsets=None,
        xai_temperature_len=-1,
        page_size=1,
        score_mod=None,
        aux_tensors=None,
        extend_seq_lens_cpu=None,
    )
    return o


def sdpa_mask(x: dict) -> torch.Tensor:
    """[B, 1, T, P + T] bool mask for requests that share one prefix length P (prefix all visible)."""
    B = x["req_pool_indices"].numel()
    T = x["tree_mask"].shape[-1]
    P = int(x["prefix_lens"][0])
    mask = torch.ones(B, 1, T, P + T, dtype=torch.bool, device=x["q"].device)
    mask[:, 0, :, P:] = x["tree_mask"].bool()                                  # [T, T] or [B, T, T]
    return mask


def sdpa_verify(x: dict, mask: torch.Tensor, k_cache=None, v_cache=None) -> torch.Tensor:
    """Gather K/V by req_to_token, then SDPA with `mask` (from sdpa_mask); every request has prefix P."""
    k_cache = x["k_cache"] if k_cache is None else k_cache
    v_cache = x["v_cache"] if v_cache is None else v_cache
    B, T, L = mask.shape[0], mask.shape[2], mask.shape[3]
    Hq, D = x["q"].shape[1], x["q"].shape[2]
    slots = x["req_to_token"][x["req_pool_indices"], :L].long()                 # [B, L]
    k = k_cache[slots].transpose(1, 2)                                          # [B, Hkv, L, D]
    v = v_cache[slots].transpose(1, 2)
    q = x["q"].view(B, T, Hq, D).transpose(1, 2)                                # [B, Hq, T, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=x["sm_scale"], enable_gqa=True)
    return o.transpose(1, 2).reshape(B * T, Hq, D)
