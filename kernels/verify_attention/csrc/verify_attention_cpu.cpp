// Tree verify attention, CPU backend: one (token, query head) row per work item, OpenMP via
// at::parallel_for, fp32 accumulation for fp32/fp16/bf16 inputs.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <limits>
#include <vector>

#include "checks.h"

namespace {

template <typename T, typename Idx>
void verify_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& r2t,
                const at::Tensor& rpi, const at::Tensor& plens, const at::Tensor& mask, float scale,
                const VerifyDims& d, at::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const Idx* rp = r2t.data_ptr<Idx>();
  const int64_t* rows = rpi.data_ptr<int64_t>();
  const int64_t* lens = plens.data_ptr<int64_t>();
  const uint8_t* mp = mask.data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  const int64_t G = d.Hq / d.Hkv, D = d.D, T_ = d.T;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, d.B * d.T * d.Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(D), acc(D), s;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t tok = i / d.Hq, h = i % d.Hq, b = tok / T_, t = tok % T_, hk = h / G;
      const int64_t P = lens[b], L = P + T_;
      const Idx* slots = rp + rows[b] * r2t.stride(0);
      const uint8_t* mrow = mp + b * mask.stride(0) + t * mask.stride(1);
      const T* qrow = qp + tok * q.stride(0) + h * q.stride(1);
      for (int64_t c = 0; c < D; ++c) qf[c] = static_cast<float>(qrow[c]) * scale;
      s.assign(L, neg_inf);
      float mx = neg_inf;
      for (int64_t j = 0; j < L; ++j) {
        if (j >= P && !mrow[(j - P) * mask.stride(2)]) continue;
        const T* krow = kp + static_cast<int64_t>(slots[j]) * k.stride(0) + hk * k.stride(1);
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
          const T* vrow = vp + static_cast<int64_t>(slots[j]) * v.stride(0) + hk * v.stride(1);
          for (int64_t c = 0; c < D; ++c) acc[c] += p * static_cast<float>(vrow[c]);
        }
      }
      T* orow = op + tok * out.stride(0) + h * out.stride(1);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      for (int64_t c = 0; c < D; ++c) orow[c] = static_cast<T>(acc[c] * inv);
    }
  });
}

}  // namespace

// num_splits is accepted for interface parity with the CUDA backend and ignored.
at::Tensor verify_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                            const at::Tensor& prefix_lens, const at::Tensor& tree_mask, double sm_scale,
                            int64_t num_splits) {
  const VerifyDims d = verify_check(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, tree_mask);
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &req_to_token, &req_pool_indices, &prefix_lens, &tree_mask})
    TORCH_CHECK(t->device().is_cpu(), "CPU backend: all tensors must be on the CPU");
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
    if (req_to_token.scalar_type() == at::kInt)
      verify_cpu<scalar_t, int32_t>(q, k_cache, v_cache, req_to_token, rpi, plens, mask, sm_scale, d, out);
    else
      verify_cpu<scalar_t, int64_t>(q, k_cache, v_cache, req_to_token, rpi, plens, mask, sm_scale, d, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("verify_attention", &verify_attention, "Tree verify attention (CPU, OpenMP)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("req_to_token"), py::arg("req_pool_indices"),
        py::arg("prefix_lens"), py::arg("tree_mask"), py::arg("sm_scale"), py::arg("num_splits") = 0);
}
