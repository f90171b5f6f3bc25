"""Paged decode attention on the CPU as a small C++ op (compiled once per machine, cached).

The torch path gathers every sequence's blocks into a padded copy before attending, which on
a CPU costs as much memory traffic as the attention itself. This op reads keys and values in
place through the block table, one sequence per task (its rows of all KV heads are contiguous,
so reads stream), every query head reading its KV head from the same row (GQA). float32 and float64.

    q (B, Hq, D), k/v_cache (N, bs, Hkv, D) strided (last dim contiguous),
    block_tables (B, M) int32, seq_lens (B,) int32  ->  out (B, Hq, D)

`load()` returns None (and the caller keeps the torch path) when no compiler is available.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("splitserve.kernels.cpu")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// A dot product with 8 independent partial sums, so the compiler vectorizes it without
// reassociating a single running sum (which strict IEEE rules forbid).
template <typename T>
static inline T dot8(const T* __restrict__ a, const T* __restrict__ b, int64_t n) {
  T p[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) p[j] += a[d + j] * b[d + j];
  T s = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

template <typename T>
static void decode_impl(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& tables, const torch::Tensor& lens, double scale, torch::Tensor& out) {
  // One task per sequence: each cached token's keys (all KV heads) are one contiguous row, so a
  // task streams whole rows block after block, which the hardware prefetcher follows best.
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k.size(1), Hkv = k.size(2), group = Hq / Hkv;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t ts0 = tables.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> scores, acc(Hq * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lp[b];
      std::fill(acc.begin(), acc.end(), T(0));
      if (L > 0) {
        scores.resize(Hq * L);
        for (int64_t t = 0; t < L; ++t) {  // scores[hq][t] = q[hq] . k[t, hq / group]
          const T* krow = kp + tp[b * ts0 + t / bs] * ks0 + (t % bs) * ks1;
          for (int64_t hq = 0; hq < Hq; ++hq)
            scores[hq * L + t] = dot8(qp + b * qs0 + hq * qs1, krow + (hq / group) * ks2, D) * T(scale);
        }
        for (int64_t hq = 0; hq < Hq; ++hq) {
          T* s = scores.data() + hq * L;
          T m = *std::max_element(s, s + L), sum = 0;
          for (int64_t t = 0; t < L; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
          const T inv = T(1) / sum;
          for (int64_t t = 0; t < L; ++t) s[t] *= inv;
        }
        for (int64_t t = 0; t < L; ++t) {  // acc[hq] += p[hq][t] * v[t, hq / group]
          const T* vrow = vp + tp[b * ts0 + t / bs] * vs0 + (t % bs) * vs1;
          for (int64_t hq = 0; hq < Hq; ++hq) {
            const T p = scores[hq * L + t];
            const T* vh = vrow + (hq / group) * vs2;
            T* a = acc.data() + hq * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * vh[d];
          }
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq)
        for (int64_t d = 0; d < D; ++d) op[b * os0 + hq * os1 + d] = acc[hq * D + d];
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables,
                           torch::Tensor lens, double scale) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "head_dim must be contiguous");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "paged_decode", [&] { decode_impl<scalar_t>(q, k, v, tables, lens, scale, out); });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "paged decode attention (CPU)"); }
"""

_module = None
_tried = False


def load():
    """The compiled module, or None when it cannot be built here (logged once)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("SPLITSERVE_CPU_KERNELS", "1") in ("0", "false", "off"):
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        _module = load_inline(name="splitserve_cpu_paged_attention_v4", cpp_sources=[_SOURCE],
                              extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                              verbose=False)
    except Exception as exc:  # no compiler, no ninja: the torch path still works
        log.warning("CPU paged attention op unavailable (%s); using the torch path", exc)
        _module = None
    return _module


def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, Hq, D) -> (B, Hq, D) through the C++ op (call load() first; it must not be None)."""
    return _module.paged_decode(q.contiguous(), k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
                                seq_lens.to(torch.int32).contiguous(), float(scale))
