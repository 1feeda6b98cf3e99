// Torch binding of the CUDA backend: checks, workspace allocation, launch on the current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include <algorithm>

#include "checks.h"
#include "verify_attention.h"

namespace {

constexpr int64_t kMaxSplits = 64;

void check_vec16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0,
              name, " must be 16-byte aligned with strides a multiple of 8 elements");
}

// Splits per request: enough blocks for ~2 waves, never more than the longest possible request needs.
int64_t pick_splits(int64_t requested, const VerifyDims& d, int64_t max_ctx, int device) {
  if (requested > 0) return std::min(requested, kMaxSplits);
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t rows = d.T * (d.Hq / d.Hkv);
  const int64_t blocks = d.B * d.Hkv * ((rows + kVerifyRowsPerBlock - 1) / kVerifyRowsPerBlock);
  const int64_t want = (2 * sms + blocks - 1) / blocks;
  const int64_t useful = std::max<int64_t>(1, (max_ctx + kVerifyTileKeys - 1) / kVerifyTileKeys);
  return std::max<int64_t>(1, std::min({want, useful, kMaxSplits}));
}

// The fields both layouts share: q, the KV pool, the output, the workspace (from torch's caching
// allocator, sized from shapes and the split count only), dims, dtype.
VerifyAttentionParams common_params(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& out, const VerifyDims& d, int64_t splits, double sm_scale,
                                    at::Tensor& part_out, at::Tensor& part_lse) {
  part_out = at::empty({d.B * d.T, d.Hq, splits, d.D}, q.options().dtype(at::kFloat));
  part_lse = at::empty({d.B * d.T, d.Hq, splits}, q.options().dtype(at::kFloat));
  VerifyAttentionParams p{};
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.partial_out = part_out.data_ptr<float>();
  p.partial_lse = part_lse.data_ptr<float>();
  p.q_stride_tok = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.k_stride_slot = k_cache.stride(0);
  p.k_stride_head = k_cache.stride(1);
  p.v_stride_slot = v_cache.stride(0);
  p.v_stride_head = v_cache.stride(1);
  p.out_stride_tok = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.B = static_cast<int>(d.B);
  p.T = static_cast<int>(d.T);
  p.Hq = static_cast<int>(d.Hq);
  p.Hkv = static_cast<int>(d.Hkv);
  p.D = static_cast<int>(d.D);
  p.num_splits = static_cast<int>(splits);
  p.sm_scale = static_cast<float>(sm_scale);
  p.bf16 = q.scalar_type() == at::kBFloat16;
  return p;
}

void check_cuda_inputs(const at::Tensor& q, const VerifyDims& d, std::initializer_list<const at::Tensor*> ts) {
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, "CUDA backend: fp16/bf16 only");
  TORCH_CHECK(d.D == 64 || d.D == 128 || d.D == 256, "CUDA backend: head_dim 64/128/256 only");
  for (const at::Tensor* t : ts)
    TORCH_CHECK(t->is_cuda() && t->get_device() == q.get_device(), "all tensors must be on q's CUDA device");
}

void launch_or_throw(const VerifyAttentionParams& p) {
  const int err = verify_attention_cuda_launch(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "verify_attention: CUDA launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

}  // namespace

at::Tensor verify_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& prefix_lens, const at::Tensor& tree_mask, double sm_scale,
                            int64_t num_splits) {
  const VerifyDims d = verify_check(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, tree_mask);
  check_cuda_inputs(q, d, {&q, &k_cache, &v_cache, &req_to_token, &req_pool_indices, &prefix_lens, &tree_mask});
  check_vec16(q, "q");
  check_vec16(k_cache, "k_cache");
  check_vec16(v_cache, "v_cache");

  const at::cuda::CUDAGuard guard(q.device());
  const at::Tensor rpi = req_pool_indices.to(at::kInt).contiguous();
  const at::Tensor plens = prefix_lens.to(at::kInt).contiguous();
  const at::Tensor mask = verify_batch_mask(tree_mask, d.B);
  const int64_t splits = pick_splits(num_splits, d, req_to_token.size(1), q.get_device());
  at::Tensor out = at::empty({d.B * d.T, d.Hq, d.D}, q.options());
  at::Tensor part_out, part_lse;
  VerifyAttentionParams p = common_params(q, k_cache, v_cache, out, d, splits, sm_scale, part_out, part_lse);
  p.layout = kLayoutReqToToken;
  p.req_to_token = req_to_token.data_ptr();
  p.req_pool_indices = rpi.data_ptr<int32_t>();
  p.prefix_lens = plens.data_ptr<int32_t>();
  p.tree_mask = mask.data_ptr<uint8_t>();
  p.r2t_stride = req_to_token.stride(0);
  p.mask_stride_b = mask.stride(0);
  p.mask_stride_q = mask.stride(1);
  p.mask_stride_k = mask.stride(2);
  p.r2t_int64 = req_to_token.scalar_type() == at::kLong;
  launch_or_throw(p);
  return out;
}

// SGLang's target-verify layout (checks.h, verify_sglang_check, documents every argument); writes o
// in place. Contract (not checked here: that would read device memory and synchronise): qo_indptr[b]
// = b*T (it is not read), kv_indptr non-decreasing, every kv_indices entry a slot of k_buffer, request
// b's T*(P_b+T) mask entries inside custom_mask from mask_indptr[b]. Lengths are read on the device;
// the split count comes from shapes only (B, Hkv, T*G, the SM count and kv_indices' length as the
// bound on P_b), so a captured CUDA graph stays valid when later replays see other prefix lengths.
void verify_attention_sglang(const at::Tensor& q, const at::Tensor& k_extend, const at::Tensor& v_extend,
                             at::Tensor& o, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                             const at::Tensor& qo_indptr, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                             const c10::optional<at::Tensor>& custom_mask, const at::Tensor& mask_indptr, int64_t T,
                             double sm_scale, int64_t num_splits) {
  const VerifyDims d = verify_sglang_check(q, k_extend, v_extend, o, k_buffer, v_buffer, qo_indptr, kv_indptr,
                                           kv_indices, custom_mask, mask_indptr, T);
  check_cuda_inputs(q, d, {&q, &k_extend, &v_extend, &o, &k_buffer, &v_buffer, &qo_indptr, &kv_indptr,
                           &kv_indices, &mask_indptr});
  if (custom_mask) check_cuda_inputs(q, d, {&*custom_mask});
  check_vec16(q, "q");
  check_vec16(k_buffer, "k_buffer");
  check_vec16(v_buffer, "v_buffer");
  check_vec16(k_extend, "k_extend");
  check_vec16(v_extend, "v_extend");
  if (d.B == 0) return;

  const at::cuda::CUDAGuard guard(q.device());
  const int64_t splits = pick_splits(num_splits, d, kv_indices.numel() + d.T, q.get_device());
  at::Tensor part_out, part_lse;
  VerifyAttentionParams p = common_params(q, k_buffer, v_buffer, o, d, splits, sm_scale, part_out, part_lse);
  p.layout = kLayoutSglang;
  p.k_extend = k_extend.data_ptr();
  p.v_extend = v_extend.data_ptr();
  p.ke_stride_tok = k_extend.stride(0);
  p.ke_stride_head = k_extend.stride(1);
  p.ve_stride_tok = v_extend.stride(0);
  p.ve_stride_head = v_extend.stride(1);
  p.kv_indptr = kv_indptr.data_ptr();
  p.kv_indptr_int64 = kv_indptr.scalar_type() == at::kLong;
  p.kv_indices = kv_indices.data_ptr<int64_t>();
  p.custom_mask = custom_mask ? verify_mask_bytes(*custom_mask).data_ptr<uint8_t>() : nullptr;
  p.mask_indptr = mask_indptr.data_ptr();
  p.mask_indptr_int64 = mask_indptr.scalar_type() == at::kLong;
  launch_or_throw(p);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("verify_attention", &verify_attention, "Tree verify attention (CUDA, split-KV + LSE merge)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("req_to_token"), py::arg("req_pool_indices"),
        py::arg("prefix_lens"), py::arg("tree_mask"), py::arg("sm_scale"), py::arg("num_splits") = 0);
  m.def("verify_attention_sglang", &verify_attention_sglang,
        "Tree verify attention in SGLang's target-verify layout, written into o (CUDA, split-KV + LSE merge)",
        py::arg("q"), py::arg("k_extend"), py::arg("v_extend"), py::arg("o"), py::arg("k_buffer"),
        py::arg("v_buffer"), py::arg("qo_indptr"), py::arg("kv_indptr"), py::arg("kv_indices"),
        py::arg("custom_mask"), py::arg("mask_indptr"), py::arg("T"), py::arg("sm_scale"), py::arg("num_splits") = 0);
}
