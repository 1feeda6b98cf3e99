"""Kernel names to classes, one table per SGLang release range (stdlib only, Python 3.8+).

A profiler trace names each device kernel (or, on the lab's stand-in, each region it wraps in
`torch.profiler.record_function`) by the name the kernel has in its source: a Triton kernel by
its `@triton.jit` function's name (a Triton build may append a specialisation suffix), an
sgl-kernel / FlashInfer / FlashAttention op by its CUDA kernel's name, NCCL by
`ncclDevKernel_*` / `ncclKernel_*`, SGLang's custom all-reduce by `cross_device_reduce_*`.
Each rule below is (class, regex searched in the name, where the name comes from: file:line of
that release's source, or the library whose kernel it is and the SGLang line that calls it).
A name no rule matches is UNKNOWN, shown with its share, never guessed.

The extend-attention kernels are also the target-verify pass's: a speculative server's verify
step (ForwardMode.TARGET_VERIFY) runs through the backend's extend path (0.5.23
srt/layers/attention/triton_backend.py forward_extend, flashinfer_backend.py's prefill
wrapper), so on a server with speculative decoding they are counted as VERIFY (classify's
`speculative`); the profile's prefills (run.py does not profile by stage) are counted with them.
"""

import re

VERIFY = "target_verify_attention"
EXTEND = "extend_attention"
DECODE = "decode_attention"
MOE_EXPERTS = "moe_experts"
MOE_ROUTING = "moe_routing"
GEMM = "dense_gemm"
COMM = "communication"
SAMPLING = "sampling"
OTHER = "other"
UNKNOWN = "unknown"
CLASSES = (VERIFY, EXTEND, DECODE, MOE_EXPERTS, MOE_ROUTING, GEMM, COMM, SAMPLING, OTHER, UNKNOWN)
ATTENTION = (VERIFY, EXTEND, DECODE)

# Names from libraries, the same in every range (the SGLang line that calls each: 0.5.23).
_LIBRARIES = (
    (VERIFY, r"^_verify_fwd|^_combine$", "kernels/verify_attention/triton_verify.py:111,220 (fleetctl's verify kernel)"),
    (EXTEND, r"BatchPrefillWith(Paged|Ragged)KVCache", "FlashInfer; srt/layers/attention/flashinfer_backend.py:535"),
    (DECODE, r"BatchDecodeWithPagedKVCache", "FlashInfer; srt/layers/attention/flashinfer_backend.py:549"),
    (EXTEND, r"flash_fwd|FlashAttnFwd",
     "FlashAttention (sgl-kernel flash_attn_with_kvcache); srt/layers/attention/flashattention_backend.py:66"),
    (MOE_ROUTING, r"topkGatingSoftmax|topk_softmax|moe_align_block_size|grouped_topk|moe_fused_gate|count_and_sort_expert",
     "sgl-kernel topk_softmax, moe_align_block_size; srt/layers/moe/topk.py:1309, "
     "srt/layers/moe/moe_runner/triton_utils/fused_moe.py:505"),
    (MOE_EXPERTS, r"moe_sum", "sgl-kernel moe_sum after the expert GEMMs; srt/layers/moe/moe_runner/triton_utils/fused_moe.py"),
    (COMM, r"^ncclDevKernel_|^ncclKernel_", "NCCL; srt/distributed/device_communicators/pynccl.py:150"),
    (COMM, r"^sglang::(out|in)place_all_reduce$", "the all-reduce custom op; srt/distributed/parallel_state.py:126 (0.4.6.post5)"),
    (COMM, r"cross_device_reduce_(1|2)stage",
     "sgl-kernel custom all-reduce; srt/distributed/device_communicators/custom_all_reduce_ops.py:44"),
    (SAMPLING, r"SamplingFromProb|TopKTopPSampling|MinPSampling|TopKRenorm|TopPRenorm|sampling_from_probs|argmax|"
               r"SoftMax|softmax|verify_tree_greedy|tree_speculative_sampling",
     "FlashInfer sampling (srt/layers/sampler.py:50), sgl-kernel's speculative acceptance (srt/speculative/eagle_utils.py)"),
    (GEMM, r"^nvjet|gemm|Gemm|GEMM|cutlass|xmma|^sm\d+_|^aten::(linear|mm|addmm|matmul|bmm)$",
     "cuBLAS / CUTLASS (torch.nn.functional.linear; on a CPU trace the aten op itself)"),
    (OTHER, r"RMSNorm|rmsnorm|Rotary|rotary|rope|store_kvcache|set_kv_buffer|elementwise_kernel|CatArrayBatchedCopy|"
            r"index_elementwise|reduce_kernel|fill_kernel|copy_kernel|embedding|act_and_mul|silu_and_mul",
     "norms, rotary, KV-cache stores, activations, torch elementwise (srt/layers/layernorm.py:628, "
     "srt/mem_cache/memory_pool.py:2133, srt/layers/activation.py)"),
)


def _triton(extend, decode, moe):
    """The Triton rules of a range: extend attention's `_fwd_kernel`, decode attention's
    `_fwd_kernel_stage1` / `_fwd_grouped_kernel_stage1` / `_fwd_kernel_stage2`, the fused MoE
    expert GEMM `fused_moe_kernel` (each name may carry a Triton suffix)."""
    return ((EXTEND, r"^_fwd_kernel(_unified)?(_\d.*)?$", extend),
            (DECODE, r"^_fwd_(grouped_)?kernel_stage[12]", decode),
            (MOE_EXPERTS, r"^fused_moe_kernel", moe))


# (first release, last release (None: open), rules): the first range whose bounds hold a version applies
RANGES = (
    ("0.4.6", "0.5.9", _triton("srt/layers/attention/triton_ops/extend_attention.py:42 (0.4.6.post5, 0.5.2)",
                               "srt/layers/attention/triton_ops/decode_attention.py:45,253,516 (0.5.2)",
                               "srt/layers/moe/fused_moe_triton/fused_moe_triton_kernels.py:296 (0.5.2)") + _LIBRARIES),
    ("0.5.10", "0.5.22", _triton("srt/layers/attention/triton_ops/extend_attention.py:220 (0.5.10)",
                                 "srt/layers/attention/triton_ops/decode_attention.py:45,253,516 (0.5.10)",
                                 "srt/layers/moe/fused_moe_triton/fused_moe_triton_kernels.py:324 (0.5.10)") + _LIBRARIES),
    ("0.5.23", None, _triton("kernels/ops/attention/extend_attention.py:375 (0.5.23)",
                             "kernels/ops/attention/decode_attention.py:235,530,935 (0.5.23)",
                             "kernels/ops/moe/fused_moe_triton_kernels.py:322 (0.5.23)") + _LIBRARIES),
)


def _vt(v):
    """The leading numbers of a version string ("0.5.2.post1" -> (0, 5, 2)); () when none."""
    out = []
    for part in str(v or "").split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group(0)))
    return tuple(out[:3])


def table(version):
    """(range label "FIRST..LAST", rules) for SGLang `version` (a string; unknown or older than
    every range: the first range, newer: the last)."""
    vt = _vt(version)
    for first, last, rules in RANGES:
        if vt and _vt(first) <= vt and (last is None or vt <= _vt(last)):
            return "%s..%s" % (first, last or ""), rules
    first, last, rules = RANGES[-1] if vt and vt > _vt(RANGES[-1][0]) else RANGES[0]
    return "%s..%s" % (first, last or ""), rules


def classify(name, rules, speculative=False):
    """The class of kernel `name` under `rules` (table()'s): the first rule whose regex is found
    in it; UNKNOWN when none. With `speculative` (the trace is of decode steps of a server with
    speculative decoding), EXTEND is VERIFY (module docstring)."""
    for cls, pattern, _ in rules:
        if re.search(pattern, name):
            return VERIFY if cls == EXTEND and speculative else cls
    return UNKNOWN
