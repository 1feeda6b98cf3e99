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

// SGLang's target-verify layout, page size 1 (kernels/verify_attention/sglang_layout.py builds it the way
// SGLang 0.5.23 / 0.5.10 TritonAttnBackend does; the sources are cited there):
//   q [B*T, Hq, D]; k_extend, v_extend [B*T, Hkv, D] (the draft tokens' K/V); o [B*T, Hq, D] (written);
//   k_buffer, v_buffer [num_slots, Hkv, D]; qo_indptr [B+1] int32/int64 (= b*T);
//   kv_indptr [B+1] int32/int64 and kv_indices int64: the prefix slots only, request b's prefix key j
//   at kv_indices[kv_indptr[b] + j], P_b = kv_indptr[b+1] - kv_indptr[b];
//   custom_mask 1-D bool/uint8 or None (causal chain): tree bit (i, j) at
//   custom_mask[mask_indptr[b] + i*(P_b+T) + P_b + j]; mask_indptr [B+1] int32/int64.
// Shapes and dtypes only (no device values are read): B = kv_indptr.size(0) - 1.
inline VerifyDims verify_sglang_check(const at::Tensor& q, const at::Tensor& k_ext, const at::Tensor& v_ext,
                                      const at::Tensor& o, const at::Tensor& k_buf, const at::Tensor& v_buf,
                                      const at::Tensor& qo_indptr, const at::Tensor& kv_indptr,
                                      const at::Tensor& kv_indices, const c10::optional<at::Tensor>& custom_mask,
                                      const at::Tensor& mask_indptr, int64_t T) {
  for (const at::Tensor* t : {&q, &k_ext, &v_ext, &o, &k_buf, &v_buf})
    TORCH_CHECK(t->dim() == 3, "q, k_extend, v_extend, o, k_buffer, v_buffer must be 3-D");
  TORCH_CHECK(k_buf.sizes() == v_buf.sizes(), "k_buffer and v_buffer shapes differ");
  TORCH_CHECK(k_ext.sizes() == v_ext.sizes(), "k_extend and v_extend shapes differ");
  for (const at::Tensor* t : {&k_ext, &v_ext, &o, &k_buf, &v_buf})
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "q, k_extend, v_extend, o, k_buffer, v_buffer dtypes differ");
  for (const at::Tensor* t : {&q, &k_ext, &v_ext, &o, &k_buf, &v_buf})
    TORCH_CHECK(t->stride(2) == 1, "head_dim must be contiguous in q, k_extend, v_extend, o, k_buffer, v_buffer");
  TORCH_CHECK(o.sizes() == q.sizes(), "o must have q's shape ", q.sizes(), ", got ", o.sizes());
  TORCH_CHECK(k_buf.size(2) == q.size(2) && k_ext.size(2) == q.size(2), "head_dim of q, k_buffer, k_extend differ");
  TORCH_CHECK(k_ext.size(1) == k_buf.size(1), "k_extend and k_buffer have different KV head counts");
  TORCH_CHECK(q.size(1) % k_buf.size(1) == 0, "Hq must be a multiple of Hkv");
  auto is_index = [](const at::Tensor& t) { return t.scalar_type() == at::kInt || t.scalar_type() == at::kLong; };
  TORCH_CHECK(kv_indptr.dim() == 1 && kv_indptr.size(0) >= 1 && is_index(kv_indptr),
              "kv_indptr must be 1-D int32/int64 [B+1]");
  const int64_t B = kv_indptr.size(0) - 1;
  TORCH_CHECK(qo_indptr.dim() == 1 && qo_indptr.size(0) == B + 1 && is_index(qo_indptr),
              "qo_indptr must be 1-D int32/int64 [B+1] with B = ", B, " (from kv_indptr)");
  TORCH_CHECK(mask_indptr.dim() == 1 && mask_indptr.size(0) == B + 1 && is_index(mask_indptr),
              "mask_indptr must be 1-D int32/int64 [B+1] with B = ", B, " (from kv_indptr)");
  TORCH_CHECK(kv_indices.dim() == 1 && kv_indices.scalar_type() == at::kLong, "kv_indices must be 1-D int64");
  if (custom_mask) {
    const auto mt = custom_mask->scalar_type();
    TORCH_CHECK(custom_mask->dim() == 1 && (mt == at::kBool || mt == at::kByte),
                "custom_mask must be 1-D bool/uint8 (SGLang's flattened FULL_MASK) or None");
    TORCH_CHECK(custom_mask->stride(0) == 1, "custom_mask must be contiguous");
  }
  for (const at::Tensor* t : {&kv_indptr, &kv_indices, &mask_indptr, &qo_indptr})
    TORCH_CHECK(t->numel() == 0 || t->stride(0) == 1,
                "qo_indptr, kv_indptr, kv_indices, mask_indptr must be contiguous");
  TORCH_CHECK(T >= 1, "T (draft tokens per request) must be >= 1, got ", T);
  TORCH_CHECK(q.size(0) == B * T, "q must have B*T rows, got ", q.size(0), " for B=", B, " T=", T);
  TORCH_CHECK(k_ext.size(0) == B * T, "k_extend must have B*T rows, got ", k_ext.size(0), " for B=", B, " T=", T);
  return {B, T, q.size(1), k_buf.size(1), q.size(2)};
}

// custom_mask as uint8 bytes (bool and uint8 share one byte per entry; no copy).
inline at::Tensor verify_mask_bytes(const at::Tensor& mask) {
  return mask.scalar_type() == at::kBool ? mask.view(at::kByte) : mask;
}

// tree_mask as a [B, T, T] uint8 view (batch stride 0 for a shared [T, T] mask).
inline at::Tensor verify_batch_mask(const at::Tensor& mask, int64_t B) {
  at::Tensor m = mask.scalar_type() == at::kBool ? mask.view(at::kByte) : mask;
  return m.dim() == 2 ? m.unsqueeze(0).expand({B, m.size(0), m.size(1)}) : m;
}
