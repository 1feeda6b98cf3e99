"""Ground truth for tree verify attention: plain torch in float64 (gather, mask, softmax).

Interface (shared by the CPU and CUDA backends' `verify_attention`), SGLang layout, page size 1:
  q                 [B*T, Hq, D]      draft-token queries, request-major (row b*T + t)
  k_cache, v_cache  [num_slots, Hkv, D]
  req_to_token      [max_reqs, max_ctx] int32/int64 slot ids; row req_pool_indices[b] holds the
                    request's prefix slots in positions [0, P_b) and its T draft tokens' slots in
                    positions [P_b, P_b + T) (their K/V are already written to the cache)
  req_pool_indices  [B] integer, prefix_lens [B] integer (P_b, draft tokens excluded)
  tree_mask         [T, T] or [B, T, T] bool: tree_mask[b, i, j] = draft token i sees draft token j
                    (ancestors and itself); every token sees its request's whole prefix
  sm_scale          softmax scale (usually D ** -0.5)
GQA: query head h reads KV head h // (Hq // Hkv). Output [B*T, Hq, D]; a row that sees no key is 0.
"""

from __future__ import annotations

from typing import Sequence

import torch


def tree_mask_from_parents(parents: Sequence[int]) -> torch.Tensor:
    """[T, T] bool mask from a parent list (parents[i] < i, -1 for a root): ancestors and self.

    Raises ValueError when a parent does not precede its child.
    """
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: a parent must precede its child (or be -1)")
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def verify_attention_ref(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, tree_mask,
                         sm_scale: float) -> torch.Tensor:
    """Tree verify attention in float64 on q's device; returns [B*T, Hq, D] float64."""
    B = req_pool_indices.numel()
    T = tree_mask.shape[-1]
    Hq, Hkv = q.shape[1], k_cache.shape[1]
    masks = tree_mask.expand(B, T, T) if tree_mask.dim() == 2 else tree_mask
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for b in range(B):
        P = int(prefix_lens[b])
        slots = req_to_token[int(req_pool_indices[b]), : P + T].long()
        k = k_cache[slots].double().repeat_interleave(Hq // Hkv, dim=1)  # [L, Hq, D]
        v = v_cache[slots].double().repeat_interleave(Hq // Hkv, dim=1)
        qb = q[b * T:(b + 1) * T].double()                                 # [T, Hq, D]
        s = torch.einsum("thd,lhd->htl", qb, k) * sm_scale
        visible = torch.ones(T, P + T, dtype=torch.bool, device=q.device)
        visible[:, P:] = masks[b].bool()
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
        out[b * T:(b + 1) * T] = torch.einsum("htl,lhd->thd", p, v)
    return out
