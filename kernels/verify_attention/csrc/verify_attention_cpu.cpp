// Tree verify attention, CPU backend: one (token, query head) row per work item, OpenMP via
// at::parallel_for, fp32 accumulation for fp32/fp16/bf16 inputs.
//
// One kernel body (verify_rows) and two index maps saying where request b's keys live:
//   ReqToTokenMap  the package's own layout: key pos of request b at slot req_to_token[row_b, pos]
//                  for pos in [0, P_b + T) (draft keys included), tree bits in tree_mask[b, t, j];
//   SglangMap      SGLang's target-verify layout (see verify_attention_sglang below): prefix key j at
//                  slot kv_indices[kv_indptr[b] + j], draft key j at row b*T + j of k_extend/v_extend,
//                  tree bit (t, j) at custom_mask[mask_indptr[b] + t*(P_b+T) + P_b + j].
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <vector>

#include "checks.h"

namespace {

// Key/value rows of one KV head: base pointer and the element strides of a [rows, Hkv, D] tensor.
template <typename T>
struct Rows {
  const T* p;
  int64_t s_row, s_head;
  const T* at(int64_t row, int64_t hk) const { return p + row * s_row + hk * s_head; }
};

template <typename T>
Rows<T> rows_of(const at::Tensor& t) {
  return {t.data_ptr<T>(), t.stride(0), t.stride(1)};
}

template <typename T, typename Idx>
struct ReqToTokenMap {
  Rows<T> k, v;
  const Idx* r2t;
  int64_t r2t_stride;
  const int64_t* rows;   // [B] row of req_to_token
  const int64_t* lens;   // [B] P_b
  const uint8_t* mask;   // [B, T, T] view (batch stride may be 0)
  int64_t m_b, m_q, m_k;

  int64_t prefix_len(int64_t b) const { return lens[b]; }
  const T* key(int64_t b, int64_t pos, int64_t hk) const { return k.at(slot(b, pos), hk); }
  const T* value(int64_t b, int64_t pos, int64_t hk) const { return v.at(slot(b, pos), hk); }
  bool draft_visible(int64_t b, int64_t t, int64_t j) const { return mask[b * m_b + t * m_q + j * m_k] != 0; }

 private:
  int64_t slot(int64_t b, int64_t pos) const { return static_cast<int64_t>(r2t[rows[b] * r2t_stride + pos]); }
};

template <typename T>
struct SglangMap {
  Rows<T> k_buf, v_buf, k_ext, v_ext;
  const int64_t* kv_indptr;    // [B + 1]
  const int64_t* kv_indices;   // prefix slots, request-major
  const uint8_t* custom_mask;  // flattened FULL_MASK, or nullptr: causal chain
  const int64_t* mask_indptr;  // [B + 1]
  int64_t n_draft;             // T, draft tokens per request

  int64_t prefix_len(int64_t b) const { return kv_indptr[b + 1] - kv_indptr[b]; }
  const T* key(int64_t b, int64_t pos, int64_t hk) const {
    const int64_t P = prefix_len(b);
    return pos < P ? k_buf.at(kv_indices[kv_indptr[b] + pos], hk) : k_ext.at(b * n_draft + pos - P, hk);
  }
  const T* value(int64_t b, int64_t pos, int64_t hk) const {
    const int64_t P = prefix_len(b);
    return pos < P ? v_buf.at(kv_indices[kv_indptr[b] + pos], hk) : v_ext.at(b * n_draft + pos - P, hk);
  }
  bool draft_visible(int64_t b, int64_t t, int64_t j) const {
    if (custom_mask == nullptr) return j <= t;
    const int64_t P = prefix_len(b);
    return custom_mask[mask_indptr[b] + t * (P + n_draft) + P + j] != 0;
  }
};

// out[b*T + t, h] = softmax over the P_b prefix keys (all visible) and the draft keys j with
// map.draft_visible(b, t, j), of (q . k) * scale, times v; query head h reads KV head h / G.
template <typename T, typename Map>
void verify_rows(const at::Tensor& q, const Map& map, float scale, const VerifyDims& d, at::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t G = d.Hq / d.Hkv, D = d.D, T_ = d.T;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, d.B * d.T * d.Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(D), acc(D), s;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tok = i / d.Hq, h = i % d.Hq, b = tok / T_, t = tok % T_, hk = h / G;
      const int64_t P = map.prefix_len(b), L = P + T_;
      const T* qrow = qp + tok * q.stride(0) + h * q.stride(1);
      for (int64_t c = 0; c < D; ++c) qf[c] = static_cast<float>(qrow[c]) * scale;
      s.assign(L, neg_inf);
      float mx = neg_inf;
      for (int64_t j = 0; j < L; ++j) {
        if (j >= P && !map.draft_visible(b, t, j - P)) continue;
        const T* krow = map.key(b, j, hk);
        float dot = 0.f;
        for (int64_t c = 0; c < D; ++c) dot += qf[c] * static_cast<float>(krow[c]);
        s[j] = dot;
        mx = std::max(mx, dot);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float l = 0.f;
      if (mx != neg_inf) {
        for (int64_t j = 0; j < L; ++j) {
          if (s[j] == neg_inf) continue;
          const float p = std::exp(s[j] - mx);
          l += p;
          const T* vrow = map.value(b, j, hk);
          for (int64_t c = 0; c < D; ++c) acc[c] += p * static_cast<float>(vrow[c]);
        }
      }
      T* orow = op + tok * out.stride(0) + h * out.stride(1);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      for (int64_t c = 0; c < D; ++c) orow[c] = static_cast<T>(acc[c] * inv);
    }
  });
}

void require_cpu(std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts) TORCH_CHECK(t->device().is_cpu(), "CPU backend: all tensors must be on the CPU");
}

}  // namespace

// num_splits is accepted for interface parity with the CUDA backend and ignored.
at::Tensor verify_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& prefix_lens, const at::Tensor& tree_mask, double sm_scale,
                            int64_t num_splits) {
  const VerifyDims d = verify_check(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, tree_mask);
  require_cpu({&q, &k_cache, &v_cache, &req_to_token, &req_pool_indices, &prefix_lens, &tree_mask});
  const at::Tensor rpi = req_pool_indices.to(at::kLong).contiguous();
  const at::Tensor plens = prefix_lens.to(at::kLong).contiguous();
  for (int64_t b = 0; b < d.B; ++b) {
    const int64_t row = rpi.data_ptr<int64_t>()[b], P = plens.data_ptr<int64_t>()[b];
    TORCH_CHECK(row >= 0 && row < req_to_token.size(0), "req_pool_indices[", b, "] out of range");
    TORCH_CHECK(P >= 0 && P + d.T <= req_to_token.size(1), "prefix_lens[", b, "] + T exceeds req_to_token width");
    const at::Tensor slots = req_to_token[row].slice(0, 0, P + d.T);
    TORCH_CHECK(P + d.T == 0 || (slots.min().item<int64_t>() >= 0 && slots.max().item<int64_t>() < k_cache.size(0)),
                "slot id out of range for request ", b);
  }
  const at::Tensor mask = verify_batch_mask(tree_mask, d.B);
  at::Tensor out = at::empty({d.B * d.T, d.Hq, d.D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "verify_attention_cpu", [&] {
    auto run = [&](auto idx_zero) {
      using Idx = decltype(idx_zero);
      const ReqToTokenMap<scalar_t, Idx> map{rows_of<scalar_t>(k_cache), rows_of<scalar_t>(v_cache),
                                             req_to_token.data_ptr<Idx>(), req_to_token.stride(0),
                                             rpi.data_ptr<int64_t>(), plens.data_ptr<int64_t>(),
                                             mask.data_ptr<uint8_t>(), mask.stride(0), mask.stride(1), mask.stride(2)};
      verify_rows<scalar_t>(q, map, static_cast<float>(sm_scale), d, out);
    };
    if (req_to_token.scalar_type() == at::kInt)
      run(int32_t{0});
    else
      run(int64_t{0});
  });
  return out;
}

// SGLang's target-verify layout (checks.h, verify_sglang_check, documents every argument); writes o
// in place. Unlike the CUDA backend this one reads the index tensors on the host to check them:
// every slot id inside k_buffer, the mask's rows inside custom_mask, qo_indptr == b * T.
void verify_attention_sglang(const at::Tensor& q, const at::Tensor& k_extend, const at::Tensor& v_extend,
                             at::Tensor& o, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
                             const at::Tensor& qo_indptr, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                             const c10::optional<at::Tensor>& custom_mask, const at::Tensor& mask_indptr, int64_t T,
                             double sm_scale, int64_t num_splits) {
  const VerifyDims d = verify_sglang_check(q, k_extend, v_extend, o, k_buffer, v_buffer, qo_indptr, kv_indptr,
                                           kv_indices, custom_mask, mask_indptr, T);
  require_cpu({&q, &k_extend, &v_extend, &o, &k_buffer, &v_buffer, &qo_indptr, &kv_indptr, &kv_indices,
               &mask_indptr});
  if (custom_mask) require_cpu({&*custom_mask});
  const at::Tensor qo = qo_indptr.to(at::kLong).contiguous();
  const at::Tensor kvp = kv_indptr.to(at::kLong).contiguous();
  const at::Tensor kvi = kv_indices.contiguous();
  const at::Tensor mip = mask_indptr.to(at::kLong).contiguous();
  const int64_t* qo_p = qo.data_ptr<int64_t>();
  const int64_t* kv_p = kvp.data_ptr<int64_t>();
  const int64_t* mi_p = mip.data_ptr<int64_t>();
  TORCH_CHECK(kv_p[0] >= 0, "kv_indptr[0] = ", kv_p[0], " is negative");
  TORCH_CHECK(kv_p[d.B] <= kvi.numel(), "kv_indptr[B] = ", kv_p[d.B], " exceeds kv_indices' length ", kvi.numel());
  for (int64_t b = 0; b < d.B; ++b) {
    TORCH_CHECK(qo_p[b] == b * d.T, "qo_indptr[", b, "] = ", qo_p[b], ", expected ", b * d.T,
                " (every request verifies T draft tokens)");
    const int64_t P = kv_p[b + 1] - kv_p[b];
    TORCH_CHECK(P >= 0, "kv_indptr decreases at request ", b);
    if (P > 0) {
      const at::Tensor slots = kvi.slice(0, kv_p[b], kv_p[b + 1]);
      TORCH_CHECK(slots.min().item<int64_t>() >= 0 && slots.max().item<int64_t>() < k_buffer.size(0),
                  "kv_indices: a prefix slot id of request ", b, " is outside k_buffer's ", k_buffer.size(0), " slots");
    }
    if (custom_mask) {
      const int64_t rows = d.T * (P + d.T);
      TORCH_CHECK(mi_p[b] >= 0 && mi_p[b + 1] - mi_p[b] >= rows && mi_p[b + 1] <= custom_mask->numel(),
                  "mask_indptr: request ", b, " needs T*(P_b+T) = ", rows, " mask entries from mask_indptr[", b,
                  "] = ", mi_p[b], " within custom_mask's ", custom_mask->numel(),
                  " (mask_indptr[b+1] = ", mi_p[b + 1], ")");
    }
  }
  TORCH_CHECK(qo_p[d.B] == d.B * d.T, "qo_indptr[B] = ", qo_p[d.B], ", expected B*T = ", d.B * d.T);
  const at::Tensor mask = custom_mask ? verify_mask_bytes(*custom_mask) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "verify_attention_sglang_cpu", [&] {
    const SglangMap<scalar_t> map{rows_of<scalar_t>(k_buffer), rows_of<scalar_t>(v_buffer),
                                  rows_of<scalar_t>(k_extend), rows_of<scalar_t>(v_extend),
                                  kv_p, kvi.data_ptr<int64_t>(), custom_mask ? mask.data_ptr<uint8_t>() : nullptr,
                                  mi_p, d.T};
    verify_rows<scalar_t>(q, map, static_cast<float>(sm_scale), d, o);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("verify_attention", &verify_attention, "Tree verify attention (CPU, OpenMP)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("req_to_token"), py::arg("req_pool_indices"),
        py::arg("prefix_lens"), py::arg("tree_mask"), py::arg("sm_scale"), py::arg("num_splits") = 0);
  m.def("verify_attention_sglang", &verify_attention_sglang,
        "Tree verify attention in SGLang's target-verify layout, written into o (CPU, OpenMP)", py::arg("q"),
        py::arg("k_extend"), py::arg("v_extend"), py::arg("o"), py::arg("k_buffer"), py::arg("v_buffer"),
        py::arg("qo_indptr"), py::arg("kv_indptr"), py::arg("kv_indices"), py::arg("custom_mask"),
        py::arg("mask_indptr"), py::arg("T"), py::arg("sm_scale"), py::arg("num_splits") = 0);
}
