// Tree verify attention, CUDA backend: split-KV over each request's prefix + draft tokens,
// then a log-sum-exp merge of the splits. No host synchronisation: graph-capturable.
//
// Block (split s, kv head h, request b, row block rb) handles kVerifyRowsPerBlock query rows
// (row = t * G + g, query head = h * G + g) against keys [s * chunk, (s + 1) * chunk) of the
// request's L = prefix_len + T keys; keys at positions >= prefix_len are draft tokens, visible
// only where the request's tree bit (t, pos - prefix_len) is set. K/V tiles of 32 keys are staged in
// shared memory with 16-byte loads; lane j scores key j, then lanes own D/32 output dims each.
// One kernel body, two index maps (where a request's keys and tree bits live): ReqToTokenMap (the
// package's layout) and SglangMap (SGLang's target-verify layout), see verify_attention.h.
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math_constants.h>
#include <cstdint>

#include "verify_attention.h"

namespace {

constexpr int kWarps = 4;
constexpr int kRowsPerWarp = kVerifyRowsPerBlock / kWarps;
constexpr int kTile = kVerifyTileKeys;
constexpr int kPad = 8;  // 16 bytes per shared row: conflict-free 16-byte reads across lanes
constexpr float kLog2e = 1.4426950408889634f;
static_assert(kTile == 32, "one key per lane");

template <typename T> struct Pair;
template <> struct Pair<__half> { using type = __half2; };
template <> struct Pair<__nv_bfloat16> { using type = __nv_bfloat162; };

__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// Dot product of 8 packed 16-bit values.
template <typename T>
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
  using T2 = typename Pair<T>::type;
  const T2* x = reinterpret_cast<const T2*>(&a);
  const T2* y = reinterpret_cast<const T2*>(&b);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 fx = to_float2(x[i]), fy = to_float2(y[i]);
    s = fmaf(fx.x, fy.x, s);
    s = fmaf(fx.y, fy.y, s);
  }
  return s;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Request b's keys in the package's layout: slot req_to_token[row_b, pos] for every pos < P_b + T.
// (The maps copy the fields they read: a reference to the kernel's parameter would move it to local memory.)
template <typename T, typename Idx>
struct ReqToTokenMap {
  const T* kc;
  const T* vc;
  const Idx* r2t;
  const uint8_t* tree;
  int64_t ks, vs, mq, mk;
  int P;

  __device__ ReqToTokenMap(const VerifyAttentionParams& p, int b, int hk)
      : kc(static_cast<const T*>(p.k_cache) + (int64_t)hk * p.k_stride_head),
        vc(static_cast<const T*>(p.v_cache) + (int64_t)hk * p.v_stride_head),
        r2t(static_cast<const Idx*>(p.req_to_token) + (int64_t)p.req_pool_indices[b] * p.r2t_stride),
        tree(p.tree_mask + (int64_t)b * p.mask_stride_b),
        ks(p.k_stride_slot), vs(p.v_stride_slot), mq(p.mask_stride_q), mk(p.mask_stride_k),
        P(p.prefix_lens[b]) {}
  __device__ const T* key(int pos) const { return kc + static_cast<int64_t>(r2t[pos]) * ks; }
  __device__ const T* value(int pos) const { return vc + static_cast<int64_t>(r2t[pos]) * vs; }
  __device__ bool draft_visible(int t, int j) const { return tree[(int64_t)t * mq + (int64_t)j * mk] != 0; }
};

__device__ __forceinline__ int64_t load_index(const void* ptr, bool is64, int i) {
  return is64 ? static_cast<const int64_t*>(ptr)[i] : static_cast<const int32_t*>(ptr)[i];
}

// Request b's keys in SGLang's target-verify layout: prefix key j at slot kv_indices[kv_indptr[b] + j],
// draft key j at row b*T + j of k_extend/v_extend; tree bit (t, j) at
// custom_mask[mask_indptr[b] + t*(P_b+T) + P_b + j], or the causal chain without a mask.
template <typename T>
struct SglangMap {
  const T* kc;
  const T* vc;
  const T* ke;   // k_extend row b*T
  const T* ve;
  const int64_t* slots;
  const uint8_t* mask;  // request b's first tree bit (row 0, draft 0), or nullptr
  int64_t ks, vs, kes, ves;
  int P, row_len;       // row_len = P_b + T: one mask row

  __device__ SglangMap(const VerifyAttentionParams& p, int b, int hk) {
    const int64_t start = load_index(p.kv_indptr, p.kv_indptr_int64, b);
    P = static_cast<int>(load_index(p.kv_indptr, p.kv_indptr_int64, b + 1) - start);
    row_len = P + p.T;
    slots = p.kv_indices + start;
    kc = static_cast<const T*>(p.k_cache) + (int64_t)hk * p.k_stride_head;
    vc = static_cast<const T*>(p.v_cache) + (int64_t)hk * p.v_stride_head;
    ke = static_cast<const T*>(p.k_extend) + (int64_t)b * p.T * p.ke_stride_tok + (int64_t)hk * p.ke_stride_head;
    ve = static_cast<const T*>(p.v_extend) + (int64_t)b * p.T * p.ve_stride_tok + (int64_t)hk * p.ve_stride_head;
    ks = p.k_stride_slot;
    vs = p.v_stride_slot;
    kes = p.ke_stride_tok;
    ves = p.ve_stride_tok;
    mask = p.custom_mask == nullptr ? nullptr
                                    : p.custom_mask + load_index(p.mask_indptr, p.mask_indptr_int64, b) + P;
  }
  __device__ const T* key(int pos) const { return pos < P ? kc + slots[pos] * ks : ke + (int64_t)(pos - P) * kes; }
  __device__ const T* value(int pos) const { return pos < P ? vc + slots[pos] * vs : ve + (int64_t)(pos - P) * ves; }
  __device__ bool draft_visible(int t, int j) const {
    return mask == nullptr ? j <= t : mask[(int64_t)t * row_len + j] != 0;
  }
};

template <typename T, typename Map, int D>
__global__ void __launch_bounds__(kWarps * 32)
split_kernel(const VerifyAttentionParams p) {
  constexpr int kVecs = D / 8;       // 16-byte vectors per head row
  constexpr int kPerLane = D / 32;   // output dims owned by one lane
  using T2 = typename Pair<T>::type;

  __shared__ __align__(16) uint16_t q_s[kVerifyRowsPerBlock][D];
  __shared__ __align__(16) uint16_t k_s[kTile][D + kPad];
  __shared__ __align__(16) uint16_t v_s[kTile][D + kPad];

  const int split = blockIdx.x;
  const int hk = blockIdx.y;
  const int G = p.Hq / p.Hkv;
  const int rows = p.T * G;
  const int row_blocks = (rows + kVerifyRowsPerBlock - 1) / kVerifyRowsPerBlock;
  const int b = blockIdx.z / row_blocks;
  const int rb = blockIdx.z % row_blocks;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  const Map map(p, b, hk);
  const int P = map.P;
  const int L = P + p.T;
  int chunk = (L + p.num_splits - 1) / p.num_splits;
  chunk = (chunk + kTile - 1) / kTile * kTile;
  const int kv_begin = split * chunk;
  const int kv_end = min(L, kv_begin + chunk);

  const T* q = static_cast<const T*>(p.q);
  for (int i = threadIdx.x; i < kVerifyRowsPerBlock * kVecs; i += blockDim.x) {
    const int r = i / kVecs, c = (i % kVecs) * 8;
    const int row = rb * kVerifyRowsPerBlock + r;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (row < rows) {
      const int t = row / G, g = row % G;
      val = __ldg(reinterpret_cast<const uint4*>(
          q + (int64_t)(b * p.T + t) * p.q_stride_tok + (int64_t)(hk * G + g) * p.q_stride_head + c));
    }
    *reinterpret_cast<uint4*>(&q_s[r][c]) = val;
  }

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kPerLane];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    m[rr] = -CUDART_INF_F;
    l[rr] = 0.f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) acc[rr][k] = 0.f;
  }

  const float scale = p.sm_scale * kLog2e;

  for (int tile = kv_begin; tile < kv_end; tile += kTile) {
    __syncthreads();  // q_s written / previous tile consumed
    for (int i = threadIdx.x; i < kTile * kVecs; i += blockDim.x) {
      const int j = i / kVecs, c = (i % kVecs) * 8;
      const int pos = tile + j;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
      if (pos < kv_end) {
        kv = __ldg(reinterpret_cast<const uint4*>(map.key(pos) + c));
        vv = __ldg(reinterpret_cast<const uint4*>(map.value(pos) + c));
      }
      *reinterpret_cast<uint4*>(&k_s[j][c]) = kv;
      *reinterpret_cast<uint4*>(&v_s[j][c]) = vv;
    }
    __syncthreads();

    const int pos = tile + lane;
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = warp * kRowsPerWarp + rr;
      const int row = rb * kVerifyRowsPerBlock + r;
      if (row >= rows) break;  // warp-uniform
      const int t = row / G;
      bool visible = pos < kv_end;
      if (visible && pos >= P) visible = map.draft_visible(t, pos - P);
      float s = -CUDART_INF_F;
      if (visible) {
        float d = 0.f;
#pragma unroll
        for (int c = 0; c < D; c += 8)
          d += dot8<T>(*reinterpret_cast<const uint4*>(&q_s[r][c]), *reinterpret_cast<const uint4*>(&k_s[lane][c]));
        s = d * scale;
      }
      const float m_new = fmaxf(m[rr], warp_max(s));
      if (m_new == -CUDART_INF_F) continue;  // nothing visible yet for this row (warp-uniform)
      const float corr = exp2f(m[rr] - m_new);
      const float pj = exp2f(s - m_new);
      l[rr] = l[rr] * corr + warp_sum(pj);
      m[rr] = m_new;
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) acc[rr][k] *= corr;
#pragma unroll 4
      for (int j = 0; j < kTile; ++j) {
        const float w = __shfl_sync(0xffffffffu, pj, j);
        const T2* vrow = reinterpret_cast<const T2*>(&v_s[j][lane * kPerLane]);
#pragma unroll
        for (int k = 0; k < kPerLane / 2; ++k) {
          const float2 v = to_float2(vrow[k]);
          acc[rr][2 * k] = fmaf(w, v.x, acc[rr][2 * k]);
          acc[rr][2 * k + 1] = fmaf(w, v.y, acc[rr][2 * k + 1]);
        }
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int row = rb * kVerifyRowsPerBlock + warp * kRowsPerWarp + rr;
    if (row >= rows) break;
    const int t = row / G, g = row % G;
    const int64_t idx = ((int64_t)(b * p.T + t) * p.Hq + hk * G + g) * p.num_splits + split;
    const float inv = l[rr] > 0.f ? 1.f / l[rr] : 0.f;
    float* o = p.partial_out + idx * D + lane * kPerLane;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) o[k] = acc[rr][k] * inv;
    if (lane == 0) p.partial_lse[idx] = l[rr] > 0.f ? m[rr] + log2f(l[rr]) : -CUDART_INF_F;
  }
}

// One block per (token, query head), one thread per head dim: weights exp2(lse_s - max).
template <typename T>
__global__ void merge_kernel(const VerifyAttentionParams p) {
  const int64_t idx = blockIdx.x;  // token * Hq + head
  const int token = static_cast<int>(idx / p.Hq), head = static_cast<int>(idx % p.Hq);
  const int d = threadIdx.x;
  const float* lse = p.partial_lse + idx * p.num_splits;
  float mx = -CUDART_INF_F;
  for (int s = 0; s < p.num_splits; ++s) mx = fmaxf(mx, lse[s]);
  float num = 0.f, den = 0.f;
  if (mx != -CUDART_INF_F) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = exp2f(lse[s] - mx);
      den += w;
      num = fmaf(w, p.partial_out[(idx * p.num_splits + s) * p.D + d], num);
    }
  }
  T* out = static_cast<T*>(p.out) + (int64_t)token * p.out_stride_tok + (int64_t)head * p.out_stride_head + d;
  store(out, den > 0.f ? num / den : 0.f);
}

template <typename T, typename Map, int D>
void launch(const VerifyAttentionParams& p, cudaStream_t stream) {
  const int rows = p.T * (p.Hq / p.Hkv);
  const int row_blocks = (rows + kVerifyRowsPerBlock - 1) / kVerifyRowsPerBlock;
  split_kernel<T, Map, D><<<dim3(p.num_splits, p.Hkv, p.B * row_blocks), kWarps * 32, 0, stream>>>(p);
  merge_kernel<T><<<p.B * p.T * p.Hq, D, 0, stream>>>(p);
}

template <typename T, typename Map>
int dispatch_dim(const VerifyAttentionParams& p, cudaStream_t stream) {
  switch (p.D) {
    case 64: launch<T, Map, 64>(p, stream); break;
    case 128: launch<T, Map, 128>(p, stream); break;
    case 256: launch<T, Map, 256>(p, stream); break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int dispatch_layout(const VerifyAttentionParams& p, cudaStream_t stream) {
  if (p.layout == kLayoutSglang) return dispatch_dim<T, SglangMap<T>>(p, stream);
  return p.r2t_int64 ? dispatch_dim<T, ReqToTokenMap<T, int64_t>>(p, stream)
                     : dispatch_dim<T, ReqToTokenMap<T, int32_t>>(p, stream);
}

}  // namespace

int verify_attention_cuda_launch(const VerifyAttentionParams& p, void* stream) {
  if (p.B == 0 || p.T == 0) return static_cast<int>(cudaSuccess);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return p.bf16 ? dispatch_layout<__nv_bfloat16>(p, s) : dispatch_layout<__half>(p, s);
}
