"""The baselines of the GPU check, called on the kernel's own inputs (kernels/verify_attention/reference.py
layout: q [B*T, Hq, D], k_cache/v_cache [num_slots, Hkv, D], req_to_token [max_reqs, max_ctx],
req_pool_indices [B], prefix_lens [B], tree_mask [T, T] or [B, T, T]).

1. SGLang's own Triton path for target-verify on NVIDIA: `extend_attention_fwd` of the 0.5.23 wheel
   (carried/extend_attention.py), called as that release's TritonAttnBackend calls it
   (sglang/srt/layers/attention/triton_backend.py):
     init_forward_metadata, forward_mode.is_target_verify(): qo_indptr, kv_indptr, kv_indices,
       custom_mask, mask_indptr as kernels/verify_attention/sglang_layout.py builds them (its
       docstring cites each line), max_extend_len = T
     forward_extend -> _forward_extend_kernel -> extend_attention_fwd(
       q.view(-1, Hq, D), k.contiguous(), v.contiguous(), o.view(-1, Hq, D), k_buffer, v_buffer,
       qo_indptr, kv_indptr, kv_indices, custom_mask, causal=True, mask_indptr, max_extend_len,
       k_descale=1.0, v_descale=1.0, layer.scaling, logit_cap=0 (no capping), sliding_window_size=-1,
       sinks=None, window_kv_offsets=None, xai_temperature_len=-1, page_size=1, score_mod=None,
       aux_tensors=None, extend_seq_lens_cpu=...)
   where k, v are the draft tokens' own K/V ([B*T, Hkv, D], already written to the pool too) and
   skip_prefix_custom_mask keeps its default True (every draft token sees the whole prefix).
   extend_seq_lens_cpu only feeds the HIP compact grid; it is passed as None.
2. SGLang 0.5.23's split-KV verify kernel `verify_splitkv_fwd` (carried/verify_splitkv.py), the same
   positional arguments in the slot forward_extend has for it (triton_backend.py:1851-1886, enabled
   only on AMD gfx95, :236-242): causal only (topk 1: it never reads custom_mask, can_handle :654-740),
   so it is timed on causal-chain trees only; it returns False when it cannot serve a call.
3. Gather + torch scaled_dot_product_attention (as kernels/verify_attention/bench.py): K/V gathered by
   req_to_token, the [B, 1, T, P + T] mask built outside the timed call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import target_verify_args


def sglang_target_verify_metadata(x: dict) -> dict:
    """SGLang's target-verify metadata for the kernel's inputs `x` (eager: custom_mask bool).

    Returns {qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, max_len_extend, slots_draft};
    slots_draft are the draft tokens' slots, request-major, to gather k_extend/v_extend from a cache.
    Built with host loops (setup, never timed); all tensors on q's device.
    """
    a = target_verify_args(x, "bool")
    B = x["req_pool_indices"].numel()
    T = a["T"]
    rows, plens = x["req_pool_indices"].tolist(), x["prefix_lens"].tolist()
    draft = [x["req_to_token"][int(rows[b]), int(plens[b]):int(plens[b]) + T].long() for b in range(B)]
    return {**{k: a[k] for k in ("qo_indptr", "kv_indptr", "kv_indices", "custom_mask", "mask_indptr")},
            "max_len_extend": T, "slots_draft": torch.cat(draft)}


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


def splitkv_target_verify(verify_splitkv_fwd, x: dict, meta: dict, k_cache=None, v_cache=None,
                          k_extend=None, v_extend=None, o=None):
    """One call of SGLang's verify_splitkv_fwd, as forward_extend's verify slot makes it
    (triton_backend.py:1857-1885, max_bs = the request pool size, here B); x must hold causal-chain
    trees. Returns o [B*T, Hq, D], or raises RuntimeError when the kernel declines (returns False)."""
    k_cache = x["k_cache"] if k_cache is None else k_cache
    v_cache = x["v_cache"] if v_cache is None else v_cache
    if k_extend is None:
        k_extend = k_cache[meta["slots_draft"]].contiguous()
        v_extend = v_cache[meta["slots_draft"]].contiguous()
    q = x["q"]
    o = torch.empty_like(q) if o is None else o
    ran = verify_splitkv_fwd(q, k_extend, v_extend, o, k_cache, v_cache, meta["qo_indptr"], meta["kv_indptr"],
                             meta["kv_indices"], meta["custom_mask"], True, meta["mask_indptr"],
                             meta["max_len_extend"], 1.0, 1.0, x["sm_scale"], logit_cap=0.0, sliding_window_size=-1,
                             sinks=None, window_kv_offsets=None, xai_temperature_len=-1,
                             max_bs=x["req_pool_indices"].numel())
    if not ran:
        raise RuntimeError("verify_splitkv_fwd returned False (can_handle refused the call)")
    return o


def zero_splitkv_scratch(verify_splitkv_fwd) -> int:
    """Zero the fp32 split partials verify_splitkv_fwd keeps between calls (its _VK_CACHE); returns
    how many buffers were zeroed. For comparisons only (a timed call never needs it): a split with no
    keys writes only its lse = -inf (verify_splitkv.py:264-277), and the combine multiplies that
    split's never-written partial output by its weight 0 (:339, :351-356), so uninitialised scratch
    holding NaN (torch.empty) turns whole rows into NaN; seen on the CPU under the interpreter."""
    import sys

    cache = sys.modules[verify_splitkv_fwd.__module__]._VK_CACHE
    for vk in cache.values():
        vk.att_out.zero_()
    return len(cache)


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
