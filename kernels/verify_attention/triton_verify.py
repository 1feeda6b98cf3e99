"""The Triton backend of verify_attention: split-KV tree verify attention on tensor cores (`tl.dot`).

Entries (both match `reference.verify_attention_ref`, both free of host synchronisation, both
capturable in a CUDA graph that stays valid for every later prefix length):

    verify_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, tree_mask,
                     sm_scale, num_splits=0) -> out [B*T, Hq, D]
        the package's interface (README.md, Interface).
    verify_attention_sglang(q, k_extend, v_extend, o, k_buffer, v_buffer, qo_indptr, kv_indptr,
                            kv_indices, custom_mask, mask_indptr, T, sm_scale, num_splits=0) -> None
        SGLang 0.5.23's target-verify layout (triton_backend.py init_forward_metadata, :1007-1061):
        q [B*T, Hq, D]; k_extend/v_extend [B*T, Hkv, D] the draft tokens' K/V; k_buffer/v_buffer
        [slots, Hkv, D] the pool (page size 1); qo_indptr [B+1] (uniform T, not read); kv_indptr [B+1]
        int32 or int64 and kv_indices int32 or int64 = the prefix slots only (prefix key j of request
        b at kv_indices[kv_indptr[b] + j]); custom_mask bool or uint8, flattened, tree bit (i, j) at
        custom_mask[mask_indptr[b] + i*(P_b+T) + P_b + j] (its prefix columns are never read);
        mask_indptr int64 = [0, cumsum(T*(P_b+T))]; custom_mask None = causal chain; `o` [B*T, Hq, D]
        written in place.
    Both: fp16/bf16, D in {64, 128, 256}, Hq = G*Hkv (head h reads KV head h // G); q/k/v/o 16-byte
    aligned, last dim contiguous, token and head strides multiples of 16 elements (ValueError
    otherwise); a query row that sees no key yields zeros. num_splits 0 = `pick_splits`.

Kernels: `_verify_fwd`, one program per (row tile, KV split; KV head; request) over the M = T*G query
rows of one KV head (row r = t*G + g: draft token t, query head h*G + g), so every K/V tile is read
once per request and split (once per row tile when M > 64). Per BLOCK_N-key tile: the slot ids, then
K and V gathered by slot (Triton's software pipeline, `num_stages`, turns these into cp.async
multi-stage loads), S = Q K^T and O += P V with tl.dot (fp16/bf16 in, fp32 accumulate), online
softmax in base 2 in registers. Prefix tiles take no tree mask (only the tile-end bound); the draft
tiles apply the tree. With one split the program writes the output; with more it writes a
normalised fp32 partial and its log2-sum-exp, and `_combine` merges the splits. Split s of request b
covers keys [s*c, (s+1)*c) of its L_b = P_b + T, c = ceil(ceil(L_b / S) / BLOCK_N) * BLOCK_N, read on
the device: a split past L_b writes lse = -inf and is ignored by the merge.

Index tensors of either integer width are read as int32 words (an int64 tensor is viewed as int32
pairs, element stride 2, its low word the value: slot ids and lengths are < 2**31; little-endian
host and device), so one compiled kernel serves int32 and int64 callers with no conversion kernel.
mask_indptr (which can pass 2**31) stays int64.

Ahead of time (deploy): `build(arch: int, out_dir) -> manifest` compiles every instantiation the
dispatch needs (`instantiations()`: D {64, 128, 256} x {fp16, bf16} x BLOCK_M {16, 32, 64} x layout
{req_to_token, sglang tree, sglang causal}, plus `_combine` per D x dtype) with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` into Triton's cache layout
under out_dir (the cubins and their metadata), and writes out_dir/manifest.json {arch, triton,
torch, instantiations: [{kernel, key, hash, dtype, D, constexprs, num_warps, num_stages, shared,
...}]}. On a host with a CUDA driver it also builds there Triton's C launcher of each kernel (what
Triton otherwise builds with gcc at a kernel's first launch; Triton's own driver utilities stay in
its usual cache, built once per host as for any Triton kernel). `load(out_dir)
-> Backend` (the object has `verify_attention` and `verify_attention_sglang`, same signatures)
checks the manifest against the running triton/torch versions and the current device's arch,
reads every kernel from out_dir by the hash the build recorded (`CompiledKernel`, never
`triton.compile`, so nothing can be compiled), and builds their launchers with Triton's cache
pointed at out_dir and its C build hook replaced by one that raises: a launcher missing from out_dir
is an error, not a silent gcc run. Call `load` with the target device current (a CUDA device is
needed to load a cubin).

Tile configuration per (arch, D, BLOCK_M) in `CONFIGS` (BLOCK_N, num_warps, num_stages) follows the
review (kernel-turn3.md 2.2: 64-key tiles at D <= 128, 32 at D 256, 2-3 stages within 99 KB of
shared memory), chosen among the candidates that compile with no spill: not timed on a GPU.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

if sys.byteorder != "little":  # the int32-word view of int64 index tensors needs it
    raise ImportError("triton_verify needs a little-endian host")

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128, 256)
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
BLOCK_MS = (16, 32, 64)
# (arch, D, BLOCK_M) -> (BLOCK_N, num_warps, num_stages): 64-key tiles at D <= 128, 32 at D 256 (and
# for sm_120's 64 x 64 tiles, which spill at 64 keys); per arch the most stages and the fewest warps
# that compile with no spill in every layout (STACK 0, no LDL/STL) and
# fit the arch's per-block shared memory (cuobjdump, triton 3.6.0; see README "Triton backend"). Not timed on a GPU.
# sm_90 (228 KB per SM, 227 KB per block): 3 stages everywhere, so the prefix loop keeps the next
# tile's K/V copies in flight while the current tile computes (BLOCK_M 64 at 2 stages waited for
# every copy at each tile; at 3, 116-134 KB, still 1 CTA/SM by registers); Triton lowers BLOCK_M 64
# to wgmma (HGMMA).
# sm_120 (100 KB per SM) and any other arch: 2 stages at D >= 128 so two programs fit on an SM.
CONFIGS = {
    90: {(64, 16): (64, 4, 3), (64, 32): (64, 8, 3), (64, 64): (64, 4, 3),
         (128, 16): (64, 4, 3), (128, 32): (64, 8, 3), (128, 64): (64, 8, 3),
         (256, 16): (32, 4, 3), (256, 32): (32, 8, 3), (256, 64): (32, 8, 3)},
    120: {(64, 16): (64, 4, 3), (64, 32): (64, 4, 3), (64, 64): (32, 4, 3),
          (128, 16): (64, 4, 2), (128, 32): (64, 8, 2), (128, 64): (64, 8, 2),
          (256, 16): (32, 8, 2), (256, 32): (32, 8, 2), (256, 64): (32, 8, 2)},
}
# layout name -> (SGLANG, CAUSAL) constexprs of _verify_fwd
LAYOUTS = {"req_to_token": (False, False), "sglang_tree": (True, False), "sglang_causal": (True, True)}
# (arch) -> (D, BLOCK_M) -> resident _verify_fwd programs per SM: `ctas_per_sm` of the compiled
# registers and shared memory (cuobjdump, triton 3.6.0), the fewest over the three layouts; the AOT
# test recomputes it from every build. Registers bound all of them (BLOCK_M >= 32 on 8 warps: 1).
CTAS_PER_SM = {
    90: {(64, 16): 4, (64, 32): 2, (64, 64): 2, (128, 16): 2, (128, 32): 1, (128, 64): 1,
         (256, 16): 2, (256, 32): 1, (256, 64): 1},
    120: {(64, 16): 2, (64, 32): 2, (64, 64): 2, (128, 16): 2, (128, 32): 1, (128, 64): 1,
          (256, 16): 2, (256, 32): 1, (256, 64): 1},
}


@triton.jit
def _verify_fwd(Q, K, V, KX, VX, O, O_PART, LSE_PART, SLOTS, STARTS, LENS, MASK, MASK_STARTS,
                slot_w, slot_row, start_w, lens_w, mask_b,
                s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_xt, s_xh, s_yt, s_yh, s_ot, s_oh,
                BT, T, G, num_splits, qk_scale,
                SGLANG: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                D: tl.constexpr):
    """One (row tile, split; KV head; request) program. SGLANG=False: SLOTS = req_to_token (row
    stride slot_row words), STARTS = req_pool_indices, LENS = prefix_lens, MASK [B|1, T, T] (batch
    stride mask_b), KX/VX unused. SGLANG=True: SLOTS = kv_indices, STARTS = kv_indptr, KX/VX =
    k_extend/v_extend, MASK = custom_mask at MASK_STARTS = mask_indptr (unused when CAUSAL)."""
    n_mt = tl.cdiv(T * G, BLOCK_M)
    mt = tl.program_id(0) % n_mt
    split = tl.program_id(0) // n_mt
    h = tl.program_id(1)
    b = tl.program_id(2)

    r = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < T * G
    t = r // G
    head = h * G + r % G
    d = tl.arange(0, D)
    q_off = (b * T + t).to(tl.int64) * s_qt + head * s_qh
    q = tl.load(Q + q_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)

    if SGLANG:
        kv_start = tl.load(STARTS + b * start_w)
        P = tl.load(STARTS + (b + 1) * start_w) - kv_start
        slot_base = kv_start.to(tl.int64) * slot_w
    else:
        P = tl.load(LENS + b * lens_w)
        slot_base = tl.load(STARTS + b * start_w).to(tl.int64) * slot_row
    L = P + T
    chunk = tl.cdiv(tl.cdiv(L, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, L)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    n = tl.arange(0, BLOCK_N)

    # prefix keys [lo, min(hi, P)): no tree mask, only the bound of the last tile. The slot ids are
    # carried one tile ahead in registers, so no K/V address of a tile waits on a load issued in its
    # own iteration: Triton's pipeliner can then issue tile i+1's K/V copies (cp.async) before
    # tile i's dots (kernel-turn4.md finding 1; the AOT test checks the SASS order).
    p_hi = tl.minimum(hi, P)
    slot_nx = tl.load(SLOTS + slot_base + (lo + n).to(tl.int64) * slot_w, mask=(lo + n) < p_hi, other=0)
    for n0 in tl.range(lo, p_hi, BLOCK_N):
        key = n0 + n
        key_ok = key < p_hi
        slot = slot_nx.to(tl.int64)
        nxt = key + BLOCK_N
        slot_nx = tl.load(SLOTS + slot_base + nxt.to(tl.int64) * slot_w, mask=nxt < p_hi, other=0)
        k = tl.load(K + slot[:, None] * s_kt + h * s_kh + d[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(V + slot[:, None] * s_vt + h * s_vh + d[None, :], mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new

    # draft keys [max(lo, P), hi) - P: the tree (or causal chain) mask
    if SGLANG and not CAUSAL:
        mask_base = tl.load(MASK_STARTS + b) + t.to(tl.int64) * L + P
    elif not SGLANG:
        mask_base = b.to(tl.int64) * mask_b + t * T
    for j0 in tl.range(tl.maximum(lo, P) - P, hi - P, BLOCK_N):
        j = j0 + n
        j_ok = j < hi - P
        if SGLANG:
            kx = KX + (b * T + j).to(tl.int64)[:, None] * s_xt + h * s_xh + d[None, :]
            vx = VX + (b * T + j).to(tl.int64)[:, None] * s_yt + h * s_yh + d[None, :]
        else:
            slot = tl.load(SLOTS + slot_base + (P + j).to(tl.int64) * slot_w, mask=j_ok, other=0).to(tl.int64)
            kx = K + slot[:, None] * s_kt + h * s_kh + d[None, :]
            vx = V + slot[:, None] * s_vt + h * s_vh + d[None, :]
        k = tl.load(kx, mask=j_ok[:, None], other=0.0)
        v = tl.load(vx, mask=j_ok[:, None], other=0.0)
        if CAUSAL:
            seen = j_ok[None, :] & (j[None, :] <= t[:, None])
        else:
            both = row_ok[:, None] & j_ok[None, :]
            seen = both & (tl.load(MASK + mask_base[:, None] + j[None, :], mask=both, other=0) != 0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m_i = m_new

    seen_any = l_i > 0.0
    out = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    if num_splits == 1:
        o_off = (b * T + t).to(tl.int64) * s_ot + head * s_oh
        tl.store(O + o_off[:, None] + d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (split * BT + b * T + t).to(tl.int64) * (G * tl.num_programs(1)) + head
        tl.store(O_PART + part[:, None] * D + d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(seen_any, m_i + tl.log2(tl.where(seen_any, l_i, 1.0)), float("-inf"))
        tl.store(LSE_PART + part, lse, mask=row_ok)


@triton.jit
def _combine(O_PART, LSE_PART, O, s_ot, s_oh, BT, HQ, num_splits, D: tl.constexpr, MAX_S: tl.constexpr,
             BLOCK_S: tl.constexpr):
    """Merge the num_splits (<= MAX_S) partials of one (token row, query head) in one pass: O_PART
    [S, BT, HQ, D] fp32 (each normalised), LSE_PART [S, BT, HQ] log2-sum-exp (-inf = the split saw
    no key). All S log-sum-exps are loaded as one vector, so every weight is known before any
    partial is read; the partials then come BLOCK_S splits at a time in an unrolled sequence of
    independent loads (no loop, no running rescale: kernel-turn4.md finding 4)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    s = tl.arange(0, MAX_S)
    lse = tl.load(LSE_PART + (s * BT + row).to(tl.int64) * HQ + head, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(tl.exp2(lse - m), 0)
    acc = tl.zeros([D], tl.float32)
    for c in tl.static_range(0, MAX_S, BLOCK_S):
        if c < num_splits:
            sc = c + tl.arange(0, BLOCK_S)
            ok = sc < num_splits
            part = (sc * BT + row).to(tl.int64) * HQ + head
            w = tl.exp2(tl.load(LSE_PART + part, mask=ok, other=float("-inf")) - m)
            acc += tl.sum(w[:, None] * tl.load(O_PART + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0), 0)
    out = acc / tl.where(l > 0.0, l, 1.0)
    tl.store(O + row.to(tl.int64) * s_ot + head * s_oh + d, out.to(O.dtype.element_ty))


def block_m(T: int, G: int) -> int:
    """Rows per program for M = T*G query rows of a KV head: 16, 32 or 64 (more rows: several tiles)."""
    return next((bm for bm in BLOCK_MS if T * G <= bm), BLOCK_MS[-1])


def config(arch: int | None, D: int, bm: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for compute capability `arch` (90, 120; any other or None,
    e.g. the interpreter: sm_120's), head dim D and BLOCK_M."""
    return CONFIGS.get(arch, CONFIGS[120])[(D, bm)]


# per-SM limits (CUDA C Programming Guide, "Compute Capabilities", table 24; sm_90 = H100/H200,
# sm_120 = RTX PRO 6000): registers, resident warps, resident CTAs, shared memory (bytes, 1 KB of it
# reserved per CTA by the driver)
SM_LIMITS = {90: dict(regs=65536, warps=64, ctas=32, shared=233472),
             120: dict(regs=65536, warps=48, ctas=32, shared=102400)}


def ctas_per_sm(arch: int | None, regs: int, shared: int, num_warps: int) -> int:
    """Resident programs per SM of a kernel using `regs` registers per thread and `shared` bytes of
    shared memory (static + dynamic) with `num_warps` warps, on sm_<arch> (any other arch or None:
    sm_120's limits). Registers are allocated per warp in units of 256 (per-thread count rounded
    up to 8), shared memory with 1 KB reserved per CTA (the CUDA occupancy calculator's rules)."""
    lim = SM_LIMITS.get(arch, SM_LIMITS[120])
    per_warp = -(-(-(-regs // 8) * 8 * 32) // 256) * 256
    by_regs = (lim["regs"] // per_warp) // num_warps
    by_smem = lim["shared"] // (shared + 1024)
    return max(1, min(by_regs, by_smem, lim["warps"] // num_warps, lim["ctas"]))


def resident(arch: int | None, D: int, bm: int) -> int:
    """CTAs per SM of `_verify_fwd`'s configuration (arch, D, BLOCK_M): the static table CTAS_PER_SM,
    which the ahead-of-time test recomputes with `ctas_per_sm` from every compiled layout's registers
    and shared memory (the fewest over the layouts)."""
    return CTAS_PER_SM.get(arch, CTAS_PER_SM[120])[(D, bm)]


# partials may take this share of the call's K/V bytes, or PARTIAL_BYTES, whichever is larger
PARTIAL_SHARE = 0.25
PARTIAL_BYTES = 8 << 20
MAX_SPLITS = 128  # the most splits a call takes (_combine's MAX_S)
COMBINE_BLOCK_S = 16  # partials _combine reads per step


def pick_splits(B: int, Hkv: int, n_mtiles: int, num_sms: int, ctas: int, max_keys: int, M: int, D: int,
                block_n: int) -> int:
    """KV splits per request from static quantities only (so a captured graph stays valid).

    B, Hkv, n_mtiles: programs per split; num_sms: the device's SM count; ctas: resident programs
    per SM of the chosen configuration (`resident`); max_keys: an upper bound of ONE request's
    P_b + T known without reading the device (the req_to_token row width, or the caller's max
    context length); M = T*G query rows per KV head; D: head dim; block_n: keys per tile.
    The rule (FA3's hopper/heuristics.h:25-62, with the bounds of kernel-turn4.md finding 3):
    no split when the programs fill 80% of the resident slots (num_sms * ctas); else the smallest
    S in 1..S_max whose wave efficiency is within 85% of the best and that fills one wave of slots,
    S_max = min(128, key tiles / 2 (>= 2 tiles per program), the partial cap: fp32 partials
    S*B*M*Hkv*D*4 bytes <= max(PARTIAL_SHARE of the K/V bytes B*max_keys*Hkv*D*4, PARTIAL_BYTES)).
    """
    base = B * Hkv * n_mtiles
    slots = num_sms * ctas
    if base >= 0.8 * slots:
        return 1
    tiles = -(-max_keys // block_n)
    per_split = B * M * Hkv * D * 4
    cap = max(PARTIAL_SHARE * B * max_keys * Hkv * D * 4, PARTIAL_BYTES)
    s_max = max(1, min(MAX_SPLITS, tiles // 2, int(cap // per_split)))
    eff = [(base * s / slots) / math.ceil(base * s / slots) for s in range(1, s_max + 1)]
    best = max(eff)
    return next((s for s in range(1, s_max + 1) if eff[s - 1] >= 0.85 * best and base * s >= slots), s_max)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """SM count of a CUDA device (cached: queried once per device); 1 on the CPU (interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _arch(device: torch.device) -> int | None:
    """Compute capability as an int (90, 120) of a CUDA device (cached); None on the CPU."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _words(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An integer index tensor as int32 words and the words per element (int64 viewed, not copied)."""
    if x.dtype == torch.int32:
        return x, 1
    if x.dtype == torch.int64:
        return x.view(torch.int32), 2
    raise TypeError(f"index tensor of dtype {x.dtype}: int32 or int64 expected")


def _check(name: str, x: torch.Tensor, dtype: torch.dtype, D: int) -> None:
    """q/k/v/o layout the compiled kernels assume (raises ValueError)."""
    if x.dtype != dtype:
        raise ValueError(f"{name}: dtype {x.dtype}, expected {dtype} (q's)")
    if x.dim() != 3 or x.shape[2] != D or x.stride(2) != 1:
        raise ValueError(f"{name}: shape {tuple(x.shape)} strides {x.stride()}: [N, H, {D}], last dim contiguous")
    if x.data_ptr() % 16 or x.stride(0) % 16 or x.stride(1) % 16:
        raise ValueError(f"{name}: needs 16-byte alignment and token/head strides that are multiples of 16")


class Backend:
    """The two entries over a kernel launcher: `launch(kernel, key, grid, args)` with `args` the
    kernel's arguments by name (constexprs included) and `key` the instantiation key."""

    def __init__(self, launch):
        self._launch = launch

    def _run(self, q, o, k, v, kx, vx, slots, starts, lens, mask, mask_starts, slot_row, mask_b, T, B,
             sglang, causal, sm_scale, num_splits, max_keys):
        """Shared host path (shapes and pointers only, no device values)."""
        dtype = q.dtype
        if dtype not in DTYPES:
            raise ValueError(f"q dtype {dtype}: the triton backend takes float16 or bfloat16")
        D = q.shape[-1]
        if D not in HEAD_DIMS:
            raise ValueError(f"head dim {D}: the triton backend takes {HEAD_DIMS}")
        for name, x in (("q", q), ("o", o), ("k", k), ("v", v), ("k_extend", kx), ("v_extend", vx)):
            _check(name, x, dtype, D)
        Hq, Hkv = q.shape[1], k.shape[1]
        if Hq % Hkv or v.shape[1] != Hkv or kx.shape[1] != Hkv:
            raise ValueError(f"heads: q {Hq}, k {Hkv}, v {v.shape[1]}: Hq must be a multiple of Hkv")
        G = Hq // Hkv
        BT = B * T
        if q.shape[0] != BT or o.shape[0] != BT or o.shape[1] != Hq:
            raise ValueError(f"q {tuple(q.shape)} / o {tuple(o.shape)}: [B*T = {BT}, {Hq}, {D}] expected")
        if BT == 0:
            return
        bm = block_m(T, G)
        n_mt = -(-(T * G) // bm)
        arch = _arch(q.device)
        block_n, num_warps, num_stages = config(arch, D, bm)
        if not 0 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits {num_splits}: 0 (pick) or 1..{MAX_SPLITS} expected")
        S = num_splits or pick_splits(B, Hkv, n_mt, _num_sms(q.device), resident(arch, D, bm), max_keys, T * G, D,
                                      block_n)
        parts = q.new_empty((S, BT, Hq, D) if S > 1 else (1,), dtype=torch.float32)
        lses = q.new_empty((S, BT, Hq) if S > 1 else (1,), dtype=torch.float32)
        slots, slot_w = _words(slots)
        starts, start_w = _words(starts)
        lens, lens_w = _words(lens)
        args = dict(Q=q, K=k, V=v, KX=kx, VX=vx, O=o, O_PART=parts, LSE_PART=lses, SLOTS=slots, STARTS=starts,
                    LENS=lens, MASK=mask, MASK_STARTS=mask_starts, slot_w=slot_w, slot_row=slot_row * slot_w,
                    start_w=start_w, lens_w=lens_w, mask_b=mask_b,
                    s_qt=q.stride(0), s_qh=q.stride(1), s_kt=k.stride(0), s_kh=k.stride(1),
                    s_vt=v.stride(0), s_vh=v.stride(1), s_xt=kx.stride(0), s_xh=kx.stride(1),
                    s_yt=vx.stride(0), s_yh=vx.stride(1), s_ot=o.stride(0), s_oh=o.stride(1),
                    BT=BT, T=T, G=G, num_splits=S, qk_scale=float(sm_scale) * LOG2E,
                    SGLANG=sglang, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=block_n, D=D)
        layout = next(name for name, flags in LAYOUTS.items() if flags == (sglang, causal))
        self._launch("fwd", fwd_key(DTYPES[dtype], D, bm, layout), (n_mt * S, Hkv, B), args, num_warps, num_stages)
        if S > 1:
            self._launch("combine", combine_key(DTYPES[dtype], D), (BT, Hq, 1),
                         dict(O_PART=parts, LSE_PART=lses, O=o, s_ot=o.stride(0), s_oh=o.stride(1), BT=BT, HQ=Hq,
                              num_splits=S, D=D, MAX_S=MAX_SPLITS, BLOCK_S=COMBINE_BLOCK_S), 4, 1)

    def verify_attention(self, q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, tree_mask,
                         sm_scale, num_splits=0):
        """The package interface (README.md); returns out [B*T, Hq, D] in q's dtype."""
        B = req_pool_indices.numel()
        T = tree_mask.shape[-1]
        if tree_mask.dim() not in (2, 3) or tree_mask.shape[-2] != T or (tree_mask.dim() == 3 and
                                                                         tree_mask.shape[0] != B):
            raise ValueError(f"tree_mask {tuple(tree_mask.shape)}: [T, T] or [B, T, T] expected")
        mask = tree_mask.contiguous()
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        if mask.dtype != torch.uint8:
            raise TypeError(f"tree_mask dtype {tree_mask.dtype}: bool or uint8 expected")
        if req_to_token.stride(1) != 1:
            raise ValueError("req_to_token: rows must be contiguous")
        out = torch.empty_like(q)
        self._run(q, out, k_cache, v_cache, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, mask,
                  prefix_lens, req_to_token.stride(0), T * T if tree_mask.dim() == 3 else 0, T, B, False, False,
                  sm_scale, num_splits, req_to_token.shape[1])
        return out

    def verify_attention_sglang(self, q, k_extend, v_extend, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                                custom_mask, mask_indptr, T, sm_scale, num_splits=0, max_context_len=0):
        """SGLang's target-verify layout (module docstring); writes `o` in place, returns None.
        max_context_len: an upper bound of one request's P_b + T (SGLang's model_runner.model_config.
        context_len), for the split count; 0 = kv_indices.numel() + T (a bound for any batch, looser
        by up to B times: more splits than needed, never wrong)."""
        B = kv_indptr.numel() - 1
        T = int(T)
        if custom_mask is None:
            mask, mask_starts = kv_indptr.view(torch.uint8), kv_indptr
        else:
            mask = custom_mask.view(torch.uint8) if custom_mask.dtype == torch.bool else custom_mask
            if mask.dtype != torch.uint8 or mask_indptr.dtype != torch.int64:
                raise TypeError(f"custom_mask {custom_mask.dtype} / mask_indptr {mask_indptr.dtype}: "
                                "bool or uint8 / int64 expected")
            mask_starts = mask_indptr
        # a request's P_b + T: the caller's bound, else the whole index buffer plus its drafts (static shapes)
        self._run(q, o, k_buffer, v_buffer, k_extend, v_extend, kv_indices, kv_indptr, kv_indptr, mask, mask_starts,
                  0, 0, T, B, True, custom_mask is None, sm_scale, num_splits,
                  int(max_context_len) or kv_indices.numel() + T)


def fwd_key(dtype: str, D: int, bm: int, layout: str) -> str:
    """Instantiation key of _verify_fwd, e.g. 'fwd-bf16-d128-m16-sglang_tree'."""
    return f"fwd-{dtype}-d{D}-m{bm}-{layout}"


def combine_key(dtype: str, D: int) -> str:
    """Instantiation key of _combine, e.g. 'combine-bf16-d128'."""
    return f"combine-{dtype}-d{D}"


_KERNELS = {"fwd": _verify_fwd, "combine": _combine}


def _jit_launch(kernel, key, grid, args, num_warps, num_stages):
    """Launch through Triton's JIT (compiles on first use; under TRITON_INTERPRET=1 interprets)."""
    _KERNELS[kernel][grid](**args, num_warps=num_warps, num_stages=num_stages)


_jit = Backend(_jit_launch)
verify_attention = _jit.verify_attention
verify_attention_sglang = _jit.verify_attention_sglang

# ---- ahead of time: build(arch, out_dir) on the deploy host, load(out_dir) in the serving process ----

_POINTERS = {"O_PART": "*fp32", "LSE_PART": "*fp32", "SLOTS": "*i32", "STARTS": "*i32", "LENS": "*i32",
             "MASK": "*u8", "MASK_STARTS": "*i64"}
_DATA = {"Q", "K", "V", "KX", "VX", "O"}  # pointers of q's dtype; every other argument is an i32
_FLOATS = {"qk_scale"}
# arguments the host path guarantees are multiples of 16 (elements, or bytes for pointers): `_check`
_DIVISIBLE_16 = {"Q", "K", "V", "KX", "VX", "O", "O_PART", "LSE_PART", "s_qt", "s_qh", "s_kt", "s_kh", "s_vt",
                 "s_vh", "s_xt", "s_xh", "s_yt", "s_yh", "s_ot", "s_oh"}
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
MANIFEST = "manifest.json"


def instantiations(arch: int) -> list[dict]:
    """Every compiled kernel the host path can launch on sm_<arch>: [{kernel, key, dtype, D,
    constexprs, signature, attrs, num_warps, num_stages}], 54 of _verify_fwd (D x dtype x BLOCK_M x
    layout) and 6 of _combine (D x dtype)."""
    out = []
    for dtype in DTYPES.values():
        for D in HEAD_DIMS:
            for bm in BLOCK_MS:
                block_n, num_warps, num_stages = config(arch, D, bm)
                for layout, (sglang, causal) in LAYOUTS.items():
                    consts = dict(SGLANG=sglang, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=block_n, D=D)
                    out.append(_inst("fwd", fwd_key(dtype, D, bm, layout), dtype, D, consts, num_warps, num_stages))
            out.append(_inst("combine", combine_key(dtype, D), dtype, D,
                             dict(D=D, MAX_S=MAX_SPLITS, BLOCK_S=COMBINE_BLOCK_S), 4, 1))
    return out


def _inst(kernel, key, dtype, D, consts, num_warps, num_stages) -> dict:
    """One instantiation: Triton signature types by argument name (constexprs marked)."""
    fn = _KERNELS[kernel]
    sig = {}
    for name, param in zip(fn.arg_names, fn.params):
        if param.is_constexpr:
            sig[name] = "constexpr"
        elif name in _FLOATS:
            sig[name] = "fp32"
        elif name in _DATA:
            sig[name] = f"*{dtype}"
        elif name in _POINTERS:
            sig[name] = _POINTERS[name]
        else:
            sig[name] = "i32"
    attrs = [fn.arg_names.index(n) for n in fn.arg_names if n in _DIVISIBLE_16]
    return dict(kernel=kernel, key=key, dtype=dtype, D=D, constexprs=consts, signature=sig, attrs=attrs,
                num_warps=num_warps, num_stages=num_stages)


def _source(inst: dict):
    """The ASTSource of an instantiation record (as `instantiations` makes and the manifest keeps)."""
    from triton.compiler import ASTSource
    attrs = {(i,): [["tt.divisibility", 16]] for i in inst["attrs"]}
    return ASTSource(_KERNELS[inst["kernel"]], inst["signature"], constexprs=inst["constexprs"], attrs=attrs)


def resources(cubin: bytes) -> dict:
    """Per-kernel resource use from Triton's bundled cuobjdump: {reg, stack, local, shared (static
    bytes), hmma, hgmma (tensor-core instruction counts in the SASS), ldgsts (asynchronous
    global-to-shared copies, cp.async: the multi-stage loads), ldl, stl (local-memory loads and
    stores)}. Raises RuntimeError when cuobjdump fails."""
    import re
    import subprocess
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True)
        sass = subprocess.run([str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage.stdout)
    if usage.returncode or sass.returncode or not m:
        raise RuntimeError(f"cuobjdump failed: {usage.stderr or sass.stderr or usage.stdout}")
    ops = {op: len(re.findall(rf"\b{op}\b", sass.stdout)) for op in ("HMMA", "HGMMA", "LDGSTS", "LDL", "STL")}
    return dict(reg=int(m[1]), stack=int(m[2]), shared=int(m[3]), local=int(m[4]),
                **{k.lower(): v for k, v in ops.items()}, loops=sass_loops(sass.stdout))


def sass_loops(sass: str) -> list[dict]:
    """The loops of a cuobjdump -sass listing, in address order: one per backward branch
    (`BRA <lower address>`), [{start, end (byte addresses of its first instruction and of the
    branch), mma (HMMA + HGMMA), ldgsts, commits (LDGDEPBAR: cp.async groups committed per
    iteration), waits: [N of each `DEPBAR.LE SB0, N` in the body, in order: wait until at most N
    committed groups are outstanding], in_flight (groups outstanding at the body's first MMA: the
    first wait's N plus the groups committed between it and that MMA; None without a wait before
    an MMA)}]. A loop with in_flight >= commits has at least one later tile's copies in flight
    while this tile's MMAs run (sm_120 listings carry scheduling annotations, `&req=`, `?trans`:
    dropped)."""
    import re
    ins = [(int(a, 16), re.sub(r"\s+[&?]\S.*$", "", op))
           for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass)]
    loops = []
    for addr, op in ins:
        br = re.match(r"(?:@!?U?P\w+\s+)?BRA(?:\.\w+)?\s+(?:\S+\s+)?0x([0-9a-f]+)$", op)
        if not br or int(br[1], 16) >= addr:
            continue
        body = [o for a, o in ins if int(br[1], 16) <= a <= addr]
        kinds = [("mma" if re.search(r"\bH(G)?MMA\b", o) else "wait" if re.search(r"\bDEPBAR\.LE SB0\b", o)
                  else "commit" if re.search(r"\bLDGDEPBAR\b", o) else "") for o in body]
        waits = [int(re.search(r"SB0,\s*(0x[0-9a-f]+|\d+)", o)[1], 0) for o, k in zip(body, kinds) if k == "wait"]
        loops.append(dict(start=int(br[1], 16), end=addr, mma=kinds.count("mma"),
                          ldgsts=sum(bool(re.search(r"\bLDGSTS\b", o)) for o in body),
                          commits=kinds.count("commit"), waits=waits, in_flight=_in_flight(kinds, waits)))
    return sorted(loops, key=lambda x: x["start"])


def _in_flight(kinds: list[str], waits: list[int]) -> int | None:
    """cp.async groups outstanding at the first "mma" of a loop body's kinds (see sass_loops)."""
    if "wait" not in kinds or "mma" not in kinds or kinds.index("wait") > kinds.index("mma"):
        return None
    return waits[0] + kinds[kinds.index("wait"):kinds.index("mma")].count("commit")


def build(arch: int, out_dir, keys=None) -> dict:
    """Compile every instantiation (or only those whose key is in `keys`) for sm_<arch> into out_dir.

    arch: compute capability as an int (90 = H100/H200, 120 = RTX PRO 6000); out_dir: a directory
    (created) that becomes a Triton cache: out_dir/<hash>/ per kernel (cubin + metadata) and, on a
    host with a CUDA driver, the kernels' C launchers. No GPU is needed to compile. Returns the
    manifest it writes to out_dir/manifest.json: {arch, triton, torch, launchers (bool: built here),
    instantiations: [instantiation record + hash, name, shared (dynamic bytes), resources]}.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    with_driver = torch.cuda.is_available()
    records = []
    with triton.knobs.cache.scope(), triton.knobs.compilation.scope():
        triton.knobs.cache.dir = str(out_dir)
        triton.knobs.compilation.store_binary_only = True
        triton.knobs.compilation.always_compile = False
        for inst in instantiations(arch):
            if keys is not None and inst["key"] not in keys:
                continue
            src = _source(inst)
            ck = triton_compile(src, target=GPUTarget("cuda", arch, 32),
                                options=dict(num_warps=inst["num_warps"], num_stages=inst["num_stages"]))
            if with_driver:  # Triton's C launcher for this signature, built now into out_dir
                triton.runtime.driver.active.launcher_cls(src, ck.metadata)
            records.append(dict(inst, hash=ck.hash, name=ck.name, shared=ck.metadata.shared,
                                resources=resources(ck.kernel)))
    manifest = dict(arch=arch, triton=triton.__version__, torch=torch.__version__, launchers=with_driver,
                    instantiations=records)
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def read_kernels(out_dir) -> tuple[dict, dict]:
    """(manifest, {key: CompiledKernel}) from a build's out_dir, by the hashes it recorded; never
    compiles (no triton.compile). Raises RuntimeError when the manifest's Triton or torch version
    differs from this process's, or a kernel's files are missing."""
    from triton.compiler import CompiledKernel
    from triton.runtime.cache import get_cache_manager
    out_dir = Path(out_dir).resolve()
    manifest = json.loads((out_dir / MANIFEST).read_text())
    if (manifest["triton"], manifest["torch"]) != (triton.__version__, torch.__version__):
        raise RuntimeError(f"{out_dir}: built with triton {manifest['triton']} / torch {manifest['torch']}, "
                           f"running triton {triton.__version__} / torch {torch.__version__}")
    kernels = {}
    for inst in manifest["instantiations"]:
        with triton.knobs.cache.scope():  # the directory Triton's cache keeps this hash in
            triton.knobs.cache.dir = str(out_dir)
            kdir = Path(get_cache_manager(inst["hash"]).cache_dir)
        group = {p.name: str(p) for p in sorted(kdir.glob(inst["name"] + ".*"))}
        if f"{inst['name']}.json" not in group or f"{inst['name']}.cubin" not in group:
            raise RuntimeError(f"{kdir}: {inst['key']} has no cubin/metadata (build incomplete?)")
        kernels[inst["key"]] = CompiledKernel(_source(inst), group, inst["hash"])
    return manifest, kernels


def _no_build(name, *args, **kwargs):
    raise RuntimeError(f"triton_verify.load: Triton would build {name} with a C compiler; the build's out_dir "
                       "lacks it (was it built on a host without a CUDA driver?)")


def load(out_dir) -> Backend:
    """The AOT-built kernels of out_dir as a Backend (`verify_attention`, `verify_attention_sglang`).

    Needs a CUDA device (the current one: the kernels are loaded onto it now) whose compute
    capability is the build's arch. Kernels come from out_dir by hash (`read_kernels`); their C
    launchers from out_dir too, with Triton's C build hook raising, so nothing is compiled. Raises
    RuntimeError on a version or arch mismatch or anything missing from out_dir.
    """
    manifest, kernels = read_kernels(out_dir)
    device = torch.device("cuda", torch.cuda.current_device())
    if _arch(device) != manifest["arch"]:
        raise RuntimeError(f"{out_dir}: built for sm_{manifest['arch']}, device {device} is sm_{_arch(device)}")
    triton.runtime.driver.active.utils  # Triton's own driver utilities, from its usual cache, before the guard
    with triton.knobs.cache.scope(), triton.knobs.build.scope():
        triton.knobs.cache.dir = str(Path(out_dir).resolve())
        triton.knobs.build.impl = _no_build
        for ck in kernels.values():
            ck._init_handles()
    names = {k: _KERNELS[k].arg_names for k in _KERNELS}

    def launch(kernel, key, grid, args, num_warps, num_stages):
        kernels[key][grid](*[args[n] for n in names[kernel]])

    return Backend(launch)
