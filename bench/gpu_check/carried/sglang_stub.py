"""The few SGLang names the carried `extend_attention.py` imports, so it runs without SGLang.

Every definition is copied from the SGLang 0.5.23 wheel (sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl),
with only what the carried file reaches kept:

  _extract_kv_strides   sglang/kernels/ops/attention/decode_attention.py (verbatim)
  unpack_aux_tensors    sglang/kernels/ops/attention/score_mod.py (verbatim)
  envs                  sglang/srt/environ.py: only the two fields extend_attention.py reads,
                        SGLANG_TRITON_FP8_PREFILL_ATTN = EnvBool(True) and
                        SGLANG_TRITON_COMPACT_EXTEND_ATTENTION = EnvBool(True), read from the
                        environment as EnvBool.get()/parse() do (both only matter on AMD gfx95/HIP)
  is_hip, is_cuda,      sglang/srt/utils/common.py (verbatim bodies, lru_cache kept)
  is_gfx95_supported,
  is_gfx1250_supported

On an NVIDIA GPU is_hip() and both gfx checks are False, so extend_attention_fwd takes its CUDA
path (block sizes by compute capability; on sm_90: BLOCK_M 128 / BLOCK_N 64 for head dim <= 128,
64 / 64 up to 256). On a CPU (TRITON_INTERPRET=1) is_cuda() is False too and the file takes its
"older architectures" block sizes (64 / 64).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch


def _extract_kv_strides(buf, page_size: int):
    """Extract (slot_stride, head_stride, page_stride, tok_stride) for a 3-D
    ``[max_slots, head_num, head_dim]`` KV buffer.

    Returns a 4-tuple of ints suitable for passing as ``stride_buf_*bs``,
    ``stride_buf_*h``, ``stride_buf_*page``, ``stride_buf_*tok``.
    """
    if buf.ndim != 3:
        raise ValueError(f"unexpected KV buffer ndim={buf.ndim}, shape={buf.shape}")
    slot_stride = buf.stride(0)
    head_stride = buf.stride(1)
    page_stride = slot_stride * page_size
    tok_stride = slot_stride
    return slot_stride, head_stride, page_stride, tok_stride


def unpack_aux_tensors(score_mod, aux_tensors):
    if score_mod is None:
        return None, 0, 0, 0
    assert aux_tensors is not None and len(aux_tensors) == 1, (
        "Triton score_mod currently requires exactly one aux tensor"
    )
    aux0 = aux_tensors[0]
    assert aux0.dim() == 3 and aux0.stride(2) == 1, (
        f"aux_tensors[0] must be 3D with a contiguous last dim, "
        f"got shape={tuple(aux0.shape)} stride={aux0.stride()}"
    )
    return aux0, aux0.stride(0), aux0.stride(1), aux0.shape[2]


class _EnvBool:
    """sglang.srt.environ.EnvBool, reduced: unset -> default; else true/1/yes/y or false/0/no/n."""

    def __init__(self, name: str, default: bool):
        self.name, self.default = name, default

    def get(self) -> bool:
        value = os.getenv(self.name)
        if value is None:
            return self.default
        value = value.lower()
        if value in ["true", "1", "yes", "y"]:
            return True
        if value in ["false", "0", "no", "n"]:
            return False
        raise ValueError(f'"{value}" is not a valid boolean value')


class _Envs:
    SGLANG_TRITON_FP8_PREFILL_ATTN = _EnvBool("SGLANG_TRITON_FP8_PREFILL_ATTN", True)
    SGLANG_TRITON_COMPACT_EXTEND_ATTENTION = _EnvBool("SGLANG_TRITON_COMPACT_EXTEND_ATTENTION", True)


envs = _Envs()


@lru_cache(maxsize=1)
def is_hip() -> bool:
    return torch.version.hip is not None


@lru_cache(maxsize=1)
def is_cuda():
    return torch.cuda.is_available() and torch.version.cuda is not None


@lru_cache(maxsize=1)
def is_gfx95_supported():
    if torch.version.hip:
        gcn_arch = torch.cuda.get_device_properties(0).gcnArchName
        return any(gfx in gcn_arch for gfx in ["gfx95"])
    else:
        return False


@lru_cache(maxsize=1)
def is_gfx1250_supported():
    if torch.version.hip:
        gcn_arch = torch.cuda.get_device_properties(0).gcnArchName
        return any(gfx in gcn_arch for gfx in ["gfx1250"])
    else:
        return False
