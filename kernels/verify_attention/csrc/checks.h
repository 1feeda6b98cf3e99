// Shape/dtype checks shared by the CPU and CUDA torch bindings.
#pragma once
#include <torch/extension.h>

struct VerifyDims {
  int64_t B, T, Hq, Hkv, D;
};

// q [B*T, Hq, D]; k_cache, v_cache [num_slots, Hkv, D]; req_to_token [max_reqs, max_ctx] int32/int64;
// req_pool_indices, prefix_lens [B] integer; tree_mask [T, T] or [B, T, T] bool/uint8.
inline VerifyDims verify_check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& r2t, const at::Tensor& rpi, const at::Tensor& plens,
                               const at::Tensor& mask) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k_cache, v_cache must be 3-D");
  TORCH_CHECK(k.sizes() == v.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "q, k_cache, v_cache dtypes differ");
  TORCH_CHECK(q.size(2) == k.size(2), "head_dim of q and k_cache differ");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(r2t.dim() == 2 && (r2t.scalar_type() == at::kInt || r2t.scalar_type() == at::kLong),
              "req_to_token must be 2-D int32/int64");
  TORCH_CHECK(r2t.stride(1) == 1, "req_to_token rows must be contiguous");
  TORCH_CHECK(rpi.dim() == 1 && plens.dim() == 1 && rpi.size(0) == plens.size(0),
              "req_pool_indices and prefix_lens must be 1-D of length B");
  TORCH_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == at::kByte, "tree_mask must be bool/uint8");
  TORCH_CHECK(mask.dim() == 2 || mask.dim() == 3, "tree_mask must be [T, T] or [B, T, T]");
  const int64_t B = rpi.size(0), T = mask.size(-1);
  TORCH_CHECK(mask.size(-2) == T && (mask.dim() == 2 || mask.size(0) == B), "tree_mask shape mismatch");
  TORCH_CHECK(q.size(0) == B * T, "q must have B*T rows, got ", q.size(0), " for B=", B, " T=", T);
  return {B, T, q.size(1), k.size(1), q.size(2)};
}

// tree_mask as a [B, T, T] uint8 view (batch stride 0 for a shared [T, T] mask).
inline at::Tensor verify_batch_mask(const at::Tensor& mask, int64_t B) {
  at::Tensor m = mask.scalar_type() == at::kBool ? mask.view(at::kByte) : mask;
  return m.dim() == 2 ? m.unsqueeze(0).expand({B, m.size(0), m.size(1)}) : m;
}
