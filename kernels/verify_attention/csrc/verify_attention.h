// Raw-pointer interface of the CUDA verify-attention kernel (no torch, no CUDA headers needed).
// The torch binding (binding_cuda.cpp) fills this struct; verify_attention.cu launches the kernels.
#pragma once
#include <cstdint>

// Where request b's keys and tree bits live: the package's own layout or SGLang's target-verify one.
enum VerifyLayout : int {
  kLayoutReqToToken = 0,  // key pos of request b at slot req_to_token[req_pool_indices[b], pos], pos < P_b + T
  kLayoutSglang = 1,      // prefix key j at slot kv_indices[kv_indptr[b] + j], draft key j at k_extend[b*T + j]
};

struct VerifyAttentionParams {
  // Tensors (device pointers). Element strides, innermost (head_dim) stride is 1.
  const void* q;                   // [B*T, Hq, D] fp16/bf16
  const void* k_cache;             // [num_slots, Hkv, D] (SGLang: k_buffer)
  const void* v_cache;             // [num_slots, Hkv, D] (SGLang: v_buffer)
  void* out;                       // [B*T, Hq, D] same dtype as q (SGLang: o, written in place)
  float* partial_out;              // workspace [B*T, Hq, num_splits, D]
  float* partial_lse;              // workspace [B*T, Hq, num_splits], log2 domain
  int64_t q_stride_tok, q_stride_head;
  int64_t k_stride_slot, k_stride_head;
  int64_t v_stride_slot, v_stride_head;
  int64_t out_stride_tok, out_stride_head;
  int B, T, Hq, Hkv, D, num_splits;
  float sm_scale;
  bool bf16;          // false: fp16
  int layout;         // VerifyLayout

  // kLayoutReqToToken
  const void* req_to_token;        // [max_reqs, max_ctx] int32 or int64 slot ids
  const int32_t* req_pool_indices; // [B] row of req_to_token per request
  const int32_t* prefix_lens;      // [B] cached prefix length per request (draft K/V follow it)
  const uint8_t* tree_mask;        // [B, T, T] (batch stride may be 0), nonzero = visible
  int64_t r2t_stride;
  int64_t mask_stride_b, mask_stride_q, mask_stride_k;
  bool r2t_int64;     // false: int32

  // kLayoutSglang (the caller's contract, not checked on the device: kv_indptr non-decreasing, every
  // kv_indices entry a slot of k_cache, mask_indptr[b] + T*(P_b+T) inside custom_mask)
  const void* k_extend;            // [B*T, Hkv, D] the draft tokens' K
  const void* v_extend;            // [B*T, Hkv, D] the draft tokens' V
  int64_t ke_stride_tok, ke_stride_head;
  int64_t ve_stride_tok, ve_stride_head;
  const void* kv_indptr;           // [B+1] int32 or int64; P_b = kv_indptr[b+1] - kv_indptr[b]
  const int64_t* kv_indices;       // prefix slots, request-major
  const uint8_t* custom_mask;      // flattened FULL_MASK (bit (t, j) at mask_indptr[b] + t*(P_b+T) + P_b + j),
                                   // nullptr: causal chain (draft j visible to draft t iff j <= t)
  const void* mask_indptr;         // [B+1] int32 or int64
  bool kv_indptr_int64, mask_indptr_int64;
};

// Query rows (draft token x head of one KV group) handled by one thread block.
constexpr int kVerifyRowsPerBlock = 16;
// Keys per tile; a split spans a multiple of this.
constexpr int kVerifyTileKeys = 32;

// Enqueues the split and merge kernels on `stream` (a cudaStream_t). Returns a cudaError_t
// value (0 = cudaSuccess). Never synchronises, so it can be captured in a CUDA graph.
int verify_attention_cuda_launch(const VerifyAttentionParams& p, void* stream);
