"""The CPU data path's hot ops as one small C++ extension (compiled once per machine, cached).

    paged_decode_attention_cpu  q (B, Hq, D), k/v_cache (N, bs, Hkv, D) strided (last dim contiguous),
                                block_tables (B, M) int32, seq_lens (B,) int32 -> (B, Hq, D);
                                float32 and float64. Reads keys and values in place through the block
                                table (the torch path gathers a padded copy first, which on a CPU costs
                                as much memory traffic as the attention itself).
    rms_norm_cpu                x (T, H) [+ residual] -> out [, x + residual]; float32
    rotary_cpu                  neox RoPE in place on q (T, Hq, D) and k (T, Hkv, D) views; float32
    silu_and_mul_cpu            (T, 2F) -> silu(gate) * up (T, F); float32
    write_kv_cpu                scatter k/v (T, Hkv, D) into the caches at slot_mapping (< 0 skipped)
    random_uniform_cpu          keys (B, 2) int64 (a row key's low and high 32 bits) -> uniforms (B, V) float32,
                                bit for bit the sampler's counter-based torch path (engine/worker/sampler.py)

Each op reads its input once and writes its output once, in place of 2-6 torch ops with their
temporaries; the float32 decode attention, RMSNorm and SiLU-mul have AVX-512 and AVX2 (8-wide FMA)
paths, one build per instruction set, the one the CPU runs loaded (`chosen_isa`); the other loops are
left to the compiler's vectoriser under the same -march. `load()` returns None (and
callers keep the torch path) when no compiler is available; `for_tensor(x)` is the module when x
is a CPU tensor of a dtype the caller's op takes and the module is built.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

log = logging.getLogger("splitserve.kernels.cpu")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
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

// A decode attention call's tensors as sizes, strides and raw pointers (q, out: (B, Hq, D);
// k, v: (N, bs, Hkv, D) strided; tables (B, M) int32; lens (B,) int32).
template <typename T>
struct Paged {
  int64_t B, Hq, D, bs, Hkv, qs0, qs1, os0, os1, ks0, ks1, ks2, vs0, vs1, vs2, ts0;
  const T *qp, *kp, *vp;
  const int32_t *tp, *lp;
  T* op;
  Paged(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& tables,
        const torch::Tensor& lens, torch::Tensor& out)
      : B(q.size(0)), Hq(q.size(1)), D(q.size(2)), bs(k.size(1)), Hkv(k.size(2)), qs0(q.stride(0)),
        qs1(q.stride(1)), os0(out.stride(0)), os1(out.stride(1)), ks0(k.stride(0)), ks1(k.stride(1)),
        ks2(k.stride(2)), vs0(v.stride(0)), vs1(v.stride(1)), vs2(v.stride(2)), ts0(tables.stride(0)),
        qp(q.data_ptr<T>()), kp(k.data_ptr<T>()), vp(v.data_ptr<T>()), tp(tables.data_ptr<int32_t>()),
        lp(lens.data_ptr<int32_t>()), op(out.data_ptr<T>()) {}
};

template <typename T>
static void decode_impl(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& tables, const torch::Tensor& lens, double scale, torch::Tensor& out) {
  // One task per sequence: each cached token's keys (all KV heads) are one contiguous row, so a
  // task streams whole rows block after block, which the hardware prefetcher follows best.
  const Paged<T> P(q, k, v, tables, lens, out);
  const int64_t D = P.D, group = P.Hq / P.Hkv;
  at::parallel_for(0, P.B, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> scores, acc(P.Hq * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = P.lp[b];
      std::fill(acc.begin(), acc.end(), T(0));
      if (L > 0) {
        scores.resize(P.Hq * L);
        for (int64_t t = 0; t < L; ++t) {  // scores[hq][t] = q[hq] . k[t, hq / group]
          const T* krow = P.kp + P.tp[b * P.ts0 + t / P.bs] * P.ks0 + (t % P.bs) * P.ks1;
          for (int64_t hq = 0; hq < P.Hq; ++hq)
            scores[hq * L + t] = dot8(P.qp + b * P.qs0 + hq * P.qs1, krow + (hq / group) * P.ks2, D) * T(scale);
        }
        for (int64_t hq = 0; hq < P.Hq; ++hq) {
          T* s = scores.data() + hq * L;
          T m = *std::max_element(s, s + L), sum = 0;
          for (int64_t t = 0; t < L; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
          const T inv = T(1) / sum;
          for (int64_t t = 0; t < L; ++t) s[t] *= inv;
        }
        for (int64_t t = 0; t < L; ++t) {  // acc[hq] += p[hq][t] * v[t, hq / group]
          const T* vrow = P.vp + P.tp[b * P.ts0 + t / P.bs] * P.vs0 + (t % P.bs) * P.vs1;
          for (int64_t hq = 0; hq < P.Hq; ++hq) {
            const T p = scores[hq * L + t];
            const T* vh = vrow + (hq / group) * P.vs2;
            T* a = acc.data() + hq * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * vh[d];
          }
        }
      }
      for (int64_t hq = 0; hq < P.Hq; ++hq)
        for (int64_t d = 0; d < D; ++d) P.op[b * P.os0 + hq * P.os1 + d] = acc[hq * D + d];
    }
  });
}

#ifdef __AVX512F__
// exp of 16 floats: x = n ln2 + r (two-part ln2), e^r by a degree-7 Taylor-like polynomial in Horner
// form (max relative error ~2e-7 on |r| <= ln2/2), times 2^n with scalef. Inputs here are <= 0.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-80.0f));  // below this a weight is < 2e-35 of the maximum's (no denormals)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 y = _mm512_set1_ps(1.0f / 5040.0f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 720.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 120.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 24.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 6.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// Ask for the rows of a block ahead of use (every other 64-byte line; the adjacent-line prefetcher
// brings its pair): a block's rows are one contiguous range when the head rows are.
static inline void prefetch_rows(const float* p, int64_t rows, int64_t row_stride, int64_t row_len) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < row_len; c += 32) _mm_prefetch(reinterpret_cast<const char*>(p + r * row_stride + c), _MM_HINT_T1);
}

constexpr int64_t PREFETCH_BLOCKS = 4;  // blocks requested ahead: enough misses in flight to stream

// Prefetch block `blk` of a sequence (if it exists) for heads from `head_off` on.
static inline void prefetch_block(const float* base, const int32_t* table, int64_t blk, int64_t L, int64_t bs,
                                  int64_t s0, int64_t s1, int64_t row_len) {
  const int64_t t0 = blk * bs;
  if (t0 < L) prefetch_rows(base + table[blk] * s0, std::min(bs, L - t0), s1, row_len);
}

// float32, head_dim = 16 * ND, block size <= 16. A task is one sequence and a range of its KV heads
// (all of them when the batch alone keeps every thread busy). One pass over the sequence's blocks
// with an online softmax: per block, each query head's 16 scores are one vector (one exp), the
// running output is rescaled and the block's values added. A block's keys and values for all heads
// are two adjacent contiguous ranges in the block-major pool, requested PREFETCH_BLOCKS ahead and
// read from memory once; a GQA group's query heads share each key and value row.
template <int ND>
static void decode_f32(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& tables, const torch::Tensor& lens, float scale, torch::Tensor& out) {
  constexpr int64_t D = 16 * ND;
  const Paged<float> P(q, k, v, tables, lens, out);
  const int64_t G = P.Hq / P.Hkv;
  const int64_t split = P.B >= 4 * at::get_num_threads() ? 1 : P.Hkv;  // head ranges per sequence
  const int64_t heads_per_task = P.Hkv / split;
  // Sequences longest first, handed out one at a time: contexts differ by 10-100x within a batch, so
  // fixed halves of the batch can leave one thread with most of the work (and a slowed core stalls
  // the other); dynamic hand-out keeps every thread busy until the end.
  std::vector<int64_t> order(P.B);
  for (int64_t b = 0; b < P.B; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return P.lp[x] > P.lp[y]; });
  const int64_t num_tasks = P.B * split;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    const int64_t nq = heads_per_task * G;  // query heads per task
    std::vector<float> acc(nq * D), qs(nq * D), m(nq), l(nq);
    alignas(64) float sc[16];
    for (int64_t task; (task = next_task.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) {
      const int64_t b = order[task / split], h0 = (task % split) * heads_per_task;
      const int64_t L = P.lp[b];
      const int32_t* table = P.tp + b * P.ts0;
      const int64_t row_len = (heads_per_task - 1) * P.ks2 + D;  // floats from head h0's row to the last head's end
      const int64_t vrow_len = (heads_per_task - 1) * P.vs2 + D;
      for (int64_t j = 0; j < nq; ++j) {
        const float* qg = P.qp + b * P.qs0 + (h0 * G + j) * P.qs1;
        for (int64_t d = 0; d < D; ++d) qs[j * D + d] = qg[d] * scale;
        m[j] = -INFINITY;
        l[j] = 0.0f;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t blk = 0; blk < PREFETCH_BLOCKS; ++blk) {
        prefetch_block(P.kp + h0 * P.ks2, table, blk, L, P.bs, P.ks0, P.ks1, row_len);
        prefetch_block(P.vp + h0 * P.vs2, table, blk, L, P.bs, P.vs0, P.vs1, vrow_len);
      }
      for (int64_t t0 = 0; t0 < L; t0 += P.bs) {
        const int64_t blk = t0 / P.bs, n = std::min(P.bs, L - t0);
        prefetch_block(P.kp + h0 * P.ks2, table, blk + PREFETCH_BLOCKS, L, P.bs, P.ks0, P.ks1, row_len);
        prefetch_block(P.vp + h0 * P.vs2, table, blk + PREFETCH_BLOCKS, L, P.bs, P.vs0, P.vs1, vrow_len);
        const float* kb = P.kp + table[blk] * P.ks0;
        const float* vb = P.vp + table[blk] * P.vs0;
        const __mmask16 live = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
        for (int64_t j = 0; j < nq; ++j) {
          const int64_t h = h0 + j / G;
          __m512 qv[ND];
          for (int c = 0; c < ND; ++c) qv[c] = _mm512_loadu_ps(qs.data() + j * D + 16 * c);
          const float* kh = kb + h * P.ks2;
          for (int64_t i = 0; i < n; ++i) {
            const float* kr = kh + i * P.ks1;
            __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
            for (int c = 1; c < ND; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), a);
            sc[i] = _mm512_reduce_add_ps(a);
          }
          const __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, sc);
          const float m_new = std::max(m[j], _mm512_reduce_max_ps(s));
          const float rescale = std::exp(m[j] - m_new);  // 0 on the first block (m = -inf)
          const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
          l[j] = l[j] * rescale + _mm512_reduce_add_ps(p);
          m[j] = m_new;
          _mm512_store_ps(sc, p);
          float* a = acc.data() + j * D;
          __m512 av[ND];
          const __m512 r = _mm512_set1_ps(rescale);
          for (int c = 0; c < ND; ++c) av[c] = _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), r);
          const float* vh = vb + h * P.vs2;
          for (int64_t i = 0; i < n; ++i) {
            const float* vr = vh + i * P.vs1;
            const __m512 pi = _mm512_set1_ps(sc[i]);
            for (int c = 0; c < ND; ++c) av[c] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(vr + 16 * c), av[c]);
          }
          for (int c = 0; c < ND; ++c) _mm512_storeu_ps(a + 16 * c, av[c]);
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        float* o = P.op + b * P.os0 + (h0 * G + j) * P.os1;
        const float inv = L > 0 ? 1.0f / l[j] : 0.0f;  // an empty context gives zeros
        for (int c = 0; c < ND; ++c)
          _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc.data() + j * D + 16 * c), _mm512_set1_ps(inv)));
      }
    }
  });
}
#endif


#if defined(__AVX2__) && defined(__FMA__)
// ---- AVX2 (8-wide fp32, FMA): the same algorithms as the AVX-512 ones above, for CPUs without AVX-512 ----
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// exp of 8 floats, exp16's method; 2^n is built in the exponent bits, so x is clamped to [-87, 88]
// (n in [-126, 127]: normal floats; below, a weight is < 2e-38 of the maximum's).
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 y = _mm256_set1_ps(1.0f / 5040.0f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 720.0f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 120.0f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 24.0f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 6.0f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// Every 64-byte line, into L2 (spread out, every other line was 1.37x slower in that replay: 3.78 s).
static inline void prefetch_rows8(const float* p, int64_t rows, int64_t row_stride, int64_t row_len) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < row_len; c += 16) _mm_prefetch(reinterpret_cast<const char*>(p + r * row_stride + c), _MM_HINT_T1);
}

static inline void prefetch_block8(const float* base, const int32_t* table, int64_t blk, int64_t L, int64_t bs,
                                   int64_t s0, int64_t s1, int64_t row_len) {
  const int64_t t0 = blk * bs;
  if (t0 < L) prefetch_rows8(base + table[blk] * s0, std::min(bs, L - t0), s1, row_len);
}

// Blocks requested ahead. The next blocks' rows are requested a few at a time between the query heads'
// passes over the current block, not all at a block's start: a burst of a whole block's prefetches
// waits on the core's few miss buffers, while spread out they keep misses in flight under the
// arithmetic (a replay of the offline workload's 2056 decode calls, cold cache, two threads: 4.34 ->
// 2.76 s; the same outputs bit for bit).
constexpr int64_t PREFETCH_BLOCKS8 = 2;

// Eight 8-wide partial sums -> one vector of their eight totals (hadd tree; one horizontal sum for
// eight tokens instead of eight).
static inline __m256 hsum8x8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Scores of up to 8 tokens from row i0 on (rows past n repeat row n - 1; the caller masks them):
// eight independent FMA chains, one per token.
template <int NV>
static inline __m256 scores8(const float* q, const float* kh, int64_t i0, int64_t n, int64_t ks1) {
  const float* rows[8];
  for (int t = 0; t < 8; ++t) rows[t] = kh + std::min<int64_t>(i0 + t, n - 1) * ks1;
  __m256 a[8];
  for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
  for (int c = 0; c < NV; ++c) {
    const __m256 qv = _mm256_loadu_ps(q + 8 * c);
    for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[t] + 8 * c), a[t]);
  }
  return hsum8x8(a);
}

// One block (<= 16 tokens) of one query head: scores (two 8-wide vectors), online-softmax update of
// (m, l), acc += p V. q: the scaled query (D floats), kh/vh: the block's rows of this KV head.
template <int NV>
static inline void attend_block8(const float* q, const float* kh, const float* vh, int64_t n, int64_t ks1,
                                 int64_t vs1, float& m, float& l, float* acc) {
  constexpr int CV = NV >= 8 ? 8 : 4;  // output vectors accumulated at once: independent FMA chains
  alignas(32) float sc[16];
  const __m256 nv = _mm256_set1_ps(float(n));
  const __m256 live0 = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), nv, _CMP_LT_OQ);
  const __m256 live1 = _mm256_cmp_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), nv, _CMP_LT_OQ);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  const __m256 s0 = _mm256_blendv_ps(ninf, scores8<NV>(q, kh, 0, n, ks1), live0);
  const __m256 s1 = n > 8 ? _mm256_blendv_ps(ninf, scores8<NV>(q, kh, 8, n, ks1), live1) : ninf;
  const float m_new = std::max(m, hmax8(_mm256_max_ps(s0, s1)));
  const float rescale = std::exp(m - m_new);  // 0 on the first block (m = -inf)
  const __m256 mv = _mm256_set1_ps(m_new);
  const __m256 p0 = _mm256_and_ps(exp8(_mm256_sub_ps(s0, mv)), live0);
  const __m256 p1 = _mm256_and_ps(exp8(_mm256_sub_ps(s1, mv)), live1);
  l = l * rescale + hsum8(_mm256_add_ps(p0, p1));
  m = m_new;
  _mm256_store_ps(sc, p0);
  _mm256_store_ps(sc + 8, p1);
  const __m256 r = _mm256_set1_ps(rescale);
  for (int c0 = 0; c0 < NV; c0 += CV) {
    __m256 av[CV];
    for (int c = 0; c < CV; ++c) av[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * (c0 + c)), r);
    for (int64_t i = 0; i < n; ++i) {
      const float* vr = vh + i * vs1 + 8 * c0;
      const __m256 pi = _mm256_set1_ps(sc[i]);
      for (int c = 0; c < CV; ++c) av[c] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vr + 8 * c), av[c]);
    }
    for (int c = 0; c < CV; ++c) _mm256_storeu_ps(acc + 8 * (c0 + c), av[c]);
  }
}

// float32, head_dim = 8 * NV (NV a multiple of 4), block size <= 16: decode_f32's task layout
// (sequences longest first, handed out dynamically; a task per KV-head range when the batch is small).
template <int NV>
static void decode_f32_avx2(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& tables, const torch::Tensor& lens, float scale, torch::Tensor& out) {
  constexpr int64_t D = 8 * NV;
  const Paged<float> P(q, k, v, tables, lens, out);
  const int64_t G = P.Hq / P.Hkv;
  const int64_t split = P.B >= 4 * at::get_num_threads() ? 1 : P.Hkv;
  const int64_t heads_per_task = P.Hkv / split;
  std::vector<int64_t> order(P.B);
  for (int64_t b = 0; b < P.B; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return P.lp[x] > P.lp[y]; });
  const int64_t num_tasks = P.B * split;
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_tasks), 1, [&](int64_t, int64_t) {
    const int64_t nq = heads_per_task * G;
    std::vector<float> acc(nq * D), qs(nq * D), m(nq), l(nq);
    for (int64_t task; (task = next_task.fetch_add(1, std::memory_order_relaxed)) < num_tasks;) {
      const int64_t b = order[task / split], h0 = (task % split) * heads_per_task;
      const int64_t L = P.lp[b];
      const int32_t* table = P.tp + b * P.ts0;
      const int64_t row_len = (heads_per_task - 1) * P.ks2 + D;
      const int64_t vrow_len = (heads_per_task - 1) * P.vs2 + D;
      for (int64_t j = 0; j < nq; ++j) {
        const float* qg = P.qp + b * P.qs0 + (h0 * G + j) * P.qs1;
        for (int64_t d = 0; d < D; ++d) qs[j * D + d] = qg[d] * scale;
        m[j] = -INFINITY;
        l[j] = 0.0f;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t blk = 0; blk < PREFETCH_BLOCKS8; ++blk) {
        prefetch_block8(P.kp + h0 * P.ks2, table, blk, L, P.bs, P.ks0, P.ks1, row_len);
        prefetch_block8(P.vp + h0 * P.vs2, table, blk, L, P.bs, P.vs0, P.vs1, vrow_len);
      }
      for (int64_t t0 = 0; t0 < L; t0 += P.bs) {
        const int64_t blk = t0 / P.bs, n = std::min(P.bs, L - t0);
        // block blk + PREFETCH_BLOCKS8's rows (if it exists), ceil(rows / nq) of them before each query head
        const int64_t ahead = (blk + PREFETCH_BLOCKS8) * P.bs;
        const int64_t ahead_rows = ahead < L ? std::min(P.bs, L - ahead) : 0;
        const float* ka = ahead_rows ? P.kp + table[blk + PREFETCH_BLOCKS8] * P.ks0 + h0 * P.ks2 : P.kp;
        const float* va = ahead_rows ? P.vp + table[blk + PREFETCH_BLOCKS8] * P.vs0 + h0 * P.vs2 : P.vp;
        const int64_t rows_per_head = (ahead_rows + nq - 1) / nq;
        const float* kb = P.kp + table[blk] * P.ks0;
        const float* vb = P.vp + table[blk] * P.vs0;
        for (int64_t j = 0; j < nq; ++j) {
          const int64_t h = h0 + j / G;
          for (int64_t r = j * rows_per_head; r < std::min(ahead_rows, (j + 1) * rows_per_head); ++r) {
            prefetch_rows8(ka + r * P.ks1, 1, 0, row_len);
            prefetch_rows8(va + r * P.vs1, 1, 0, vrow_len);
          }
          attend_block8<NV>(qs.data() + j * D, kb + h * P.ks2, vb + h * P.vs2, n, P.ks1, P.vs1, m[j], l[j],
                            acc.data() + j * D);
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        float* o = P.op + b * P.os0 + (h0 * G + j) * P.os1;
        const float inv = L > 0 ? 1.0f / l[j] : 0.0f;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[j * D + d] * inv;
      }
    }
  });
}
#endif

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables,
                           torch::Tensor lens, double scale) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(q.size(1) % k.size(2) == 0, "paged_decode: ", q.size(1), " query heads are not a multiple of ",
              k.size(2), " KV heads");
  {  // every block a sequence reads must exist: a bad table would read outside the pool
    const int64_t B = q.size(0), M = tables.size(1), bs = k.size(1), N = k.size(0), ts0 = tables.stride(0);
    const int32_t* tp = tables.data_ptr<int32_t>();
    const int32_t* lp = lens.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(lp[b] >= 0 && lp[b] <= M * bs, "paged_decode: sequence ", b, " has length ", lp[b],
                  "; its block table holds at most ", M * bs, " tokens");
      for (int64_t j = 0; j * bs < lp[b]; ++j)
        TORCH_CHECK(tp[b * ts0 + j] >= 0 && tp[b * ts0 + j] < N, "paged_decode: sequence ", b, " block ", j, " is ",
                    tp[b * ts0 + j], "; the pool has blocks 0..", N - 1);
    }
  }
  auto out = torch::empty_like(q);
#ifdef __AVX512F__
  if (q.scalar_type() == torch::kFloat && q.size(1) % k.size(2) == 0 && k.size(1) <= 16) {
    switch (q.size(2)) {
      case 32: decode_f32<2>(q, k, v, tables, lens, float(scale), out); return out;
      case 64: decode_f32<4>(q, k, v, tables, lens, float(scale), out); return out;
      case 128: decode_f32<8>(q, k, v, tables, lens, float(scale), out); return out;
      default: break;
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (q.scalar_type() == torch::kFloat && q.size(1) % k.size(2) == 0 && k.size(1) <= 16) {
    switch (q.size(2)) {
      case 32: decode_f32_avx2<4>(q, k, v, tables, lens, float(scale), out); return out;
      case 64: decode_f32_avx2<8>(q, k, v, tables, lens, float(scale), out); return out;
      case 128: decode_f32_avx2<16>(q, k, v, tables, lens, float(scale), out); return out;
      default: break;
    }
  }
#endif
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "paged_decode", [&] { decode_impl<scalar_t>(q, k, v, tables, lens, scale, out); });
  return out;
}


// ---- elementwise ops (float32) ----------------------------------------------------------------

// Rows per parallel task: small inputs (a decode step's few rows) stay on one thread.
static inline int64_t grain_rows(int64_t row_len) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_len)); }

#ifdef __AVX512F__
static inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }
#endif

std::vector<torch::Tensor> rms_norm_f32(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor w,
                                        double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat, "rms_norm_cpu: x must be (T, H) float32, rows contiguous");
  const int64_t T = x.size(0), H = x.size(1);
  auto out = torch::empty({T, H}, x.options());
  torch::Tensor res_out, res;
  if (residual.has_value()) {
    res = residual->contiguous();
    res_out = torch::empty({T, H}, x.options());
  }
  const float* xp = x.data_ptr<float>();
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  float* rop = res_out.defined() ? res_out.data_ptr<float>() : nullptr;
  const float* wp = w.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, T, grain_rows(H), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* h = xp + t * xs;
      if (rp) {  // new residual = x + residual, then normalise it
        float* r = rop + t * H;
#pragma omp simd
        for (int64_t d = 0; d < H; ++d) r[d] = h[d] + rp[t * H + d];
        h = r;
      }
      float sum = 0.0f;
      int64_t d = 0;
#ifdef __AVX512F__
      __m512 acc = _mm512_setzero_ps();  // 16 partial sums of squares
      for (; d + 16 <= H; d += 16) {
        const __m512 v = _mm512_loadu_ps(h + d);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();  // 16 partial sums of squares
      for (; d + 16 <= H; d += 16) {
        const __m256 v0 = _mm256_loadu_ps(h + d), v1 = _mm256_loadu_ps(h + d + 8);
        acc0 = _mm256_fmadd_ps(v0, v0, acc0);
        acc1 = _mm256_fmadd_ps(v1, v1, acc1);
      }
      for (; d + 8 <= H; d += 8) {
        const __m256 v0 = _mm256_loadu_ps(h + d);
        acc0 = _mm256_fmadd_ps(v0, v0, acc0);
      }
      sum = hsum8(_mm256_add_ps(acc0, acc1));
#endif
      for (; d < H; ++d) sum += h[d] * h[d];
      const float inv = 1.0f / std::sqrt(sum / float(H) + float(eps));
      float* o = op + t * H;
#pragma omp simd
      for (int64_t e = 0; e < H; ++e) o[e] = wp[e] * (h[e] * inv);
    }
  });
  if (res_out.defined()) return {out, res_out};
  return {out};
}

void rotary_f32(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cache) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cache.is_contiguous(), "rotary_cpu: head_dim must be contiguous");
  const int64_t T = q.size(0), Hq = q.size(1), Hk = k.size(1), D = q.size(2), half = D / 2;
  const int64_t* pp = positions.data_ptr<int64_t>();
  const float* cp = cache.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  at::parallel_for(0, T, grain_rows((Hq + Hk) * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cp + pp[t] * D;
      const float* sin = cos + half;
      for (int64_t h = 0; h < Hq + Hk; ++h) {
        float* x = h < Hq ? qp + t * qs0 + h * qs1 : kp + t * ks0 + (h - Hq) * ks1;
        for (int64_t d = 0; d < half; ++d) {
          const float x1 = x[d], x2 = x[d + half];
          x[d] = x1 * cos[d] - x2 * sin[d];
          x[d + half] = x2 * cos[d] + x1 * sin[d];
        }
      }
    }
  });
}

torch::Tensor silu_and_mul_f32(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat, "silu_and_mul_cpu: x must be (T, 2F) float32");
  const int64_t T = x.size(0), F = x.size(1) / 2, xs = x.stride(0);
  auto out = torch::empty({T, F}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(2 * F), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * xs;
      const float* u = g + F;
      float* o = op + t * F;
      int64_t d = 0;
#ifdef __AVX512F__
      for (; d < F; d += 16) {  // silu(g) = g / (1 + exp(-g))
        const __mmask16 m = tail_mask(F - d);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + d);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(o + d, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + d)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      for (; d + 8 <= F; d += 8) {  // silu(g) = g / (1 + exp(-g)); the tail below
        const __m256 gv = _mm256_loadu_ps(g + d);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(o + d, _mm256_mul_ps(s, _mm256_loadu_ps(u + d)));
      }
#endif
      for (; d < F; ++d) o[d] = g[d] / (1.0f + std::exp(-g[d])) * u[d];
    }
  });
  return out;
}

void write_kv_f32(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache, torch::Tensor v_cache,
                  torch::Tensor slots) {
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "write_kv_cpu: head_dim must be contiguous");
  const int64_t T = key.size(0), H = key.size(1), D = key.size(2), bs = k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);
  const int64_t c0 = k_cache.stride(0), c1 = k_cache.stride(1), c2 = k_cache.stride(2);
  const int64_t d0 = v_cache.stride(0), d1 = v_cache.stride(1), d2 = v_cache.stride(2);
  at::parallel_for(0, T, grain_rows(2 * H * D), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;  // padding
      const int64_t blk = slot / bs, off = slot % bs;
      TORCH_CHECK(blk < k_cache.size(0), "write_kv: slot ", slot, " is past the pool's ", k_cache.size(0) * bs, " slots");
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(kc + blk * c0 + off * c1 + h * c2, kp + t * ks0 + h * ks1, D * sizeof(float));
        std::memcpy(vc + blk * d0 + off * d1 + h * d2, vp + t * vs0 + h * vs1, D * sizeof(float));
      }
    }
  });
}

// murmur3's 32-bit finalizer; unsigned arithmetic wraps mod 2**32 by definition.
static inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// Counter-based uniforms (B, V) float32 from per-row key halves (B, 2) int64, each in [0, 2**32): entry (i, v)
// is fmix32(fmix32(v * 0x9E3779B1) ^ k0) ^ k1, its top 23 bits m as (2m + 1) / 2**24, the same bits as the
// sampler's torch path. The torch path spends ~25 passes of int64 temporaries per entry; this is one write.
torch::Tensor random_uniform(torch::Tensor keys, int64_t V) {
  TORCH_CHECK(keys.dim() == 2 && keys.size(1) == 2 && keys.scalar_type() == torch::kLong,
              "random_uniform_cpu: keys must be (B, 2) int64");
  const torch::Tensor k = keys.contiguous();
  const int64_t B = k.size(0);
  const int64_t* kp = k.data_ptr<int64_t>();
  torch::Tensor out = torch::empty({B, V}, torch::dtype(torch::kFloat));
  float* op = out.data_ptr<float>();
  std::vector<uint32_t> vocab_hash(V);
  for (int64_t v = 0; v < V; ++v) vocab_hash[v] = fmix32(static_cast<uint32_t>(v) * 0x9E3779B1u);
  const uint32_t* vh = vocab_hash.data();
  at::parallel_for(0, B, grain_rows(V), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint32_t k0 = static_cast<uint32_t>(kp[2 * i]), k1 = static_cast<uint32_t>(kp[2 * i + 1]);
      float* o = op + i * V;
      for (int64_t v = 0; v < V; ++v) {
        const uint32_t h = fmix32(vh[v] ^ k0) ^ k1;
        o[v] = static_cast<float>(static_cast<int32_t>(((h >> 9) << 1) + 1u)) * 0x1p-24f;
      }
    }
  });
  return out;
}

// The vector path this build compiled in (its -march), for logs and tests.
std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "generic";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa, "the vector instruction set this build uses: avx512, avx2 or generic");
  m.def("paged_decode", &paged_decode, "paged decode attention (CPU)");
  m.def("rms_norm", &rms_norm_f32, "RMSNorm, optionally after a residual add (CPU, float32)");
  m.def("rotary", &rotary_f32, "neox rotary embedding in place (CPU, float32)");
  m.def("silu_and_mul", &silu_and_mul_f32, "silu(gate) * up (CPU, float32)");
  m.def("write_kv", &write_kv_f32, "scatter keys/values into the paged caches (CPU, float32)");
  m.def("random_uniform", &random_uniform, "counter-based uniforms in (0, 1) from per-row keys (CPU, float32)");
}
"""

_NAME = "splitserve_cpu_ops_v8"  # + "_<isa>": one build per instruction set
# The vector path is chosen at build time by -march; which build to load, at run time from the CPU's
# flags (torch's own detection): AVX-512 CPUs keep the build they always had (-march=native), AVX2
# ones get the 8-wide FMA paths (x86-64-v3), anything else the plain loops. SPLITSERVE_CPU_ISA forces
# one (auto | avx512 | avx2 | generic), e.g. to run the AVX2 build on an AVX-512 machine.
ISA_CFLAGS = {
    "avx512": ("-O3", "-march=native", "-fopenmp"),
    "avx2": ("-O3", "-march=x86-64-v3", "-mtune=native", "-fopenmp"),
    "generic": ("-O3", "-fopenmp"),
}
_LDFLAGS = ("-fopenmp",)
# torch's load_inline holds a lock file in the build directory while it checks the build, even when there
# is nothing to build; a process killed inside that window (a crash test, Ctrl-C at start) leaves the
# lock, and every later load waits on it forever. So a build that is already there is imported directly.
_STALE_LOCK_S = 300.0
_module = None
_tried = False


def cpu_isa() -> str:
    """The widest vector path this CPU runs: avx512, avx2 or generic (torch's CPU capability)."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    if capability.startswith("AVX512"):
        return "avx512"
    if capability == "AVX2":
        return "avx2"
    return "generic"


def chosen_isa() -> str:
    """SPLITSERVE_CPU_ISA when set (checked against the CPU), else cpu_isa()."""
    wanted = os.environ.get("SPLITSERVE_CPU_ISA", "auto").strip().lower() or "auto"
    if wanted == "auto":
        return cpu_isa()
    if wanted not in ISA_CFLAGS:
        raise ValueError(f"SPLITSERVE_CPU_ISA={wanted!r}: choose one of auto, {', '.join(ISA_CFLAGS)}")
    order = ["generic", "avx2", "avx512"]
    if order.index(wanted) > order.index(cpu_isa()):
        raise ValueError(
            f"SPLITSERVE_CPU_ISA={wanted}: this CPU runs at most {cpu_isa()}; unset it or choose a narrower one"
        )
    return wanted


def module_name(isa: str) -> str:
    return f"{_NAME}_{isa}"


def _stamp(isa: str) -> str:
    """What the built library was made from: the source, the flags, torch's version."""
    import hashlib

    parts = [_SOURCE, *ISA_CFLAGS[isa], *_LDFLAGS, torch.__version__]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _import_built(build_dir: str, isa: str):
    """The library already built from this very source, imported without touching the lock; else None."""
    import importlib.util

    name = module_name(isa)
    library, stamp = os.path.join(build_dir, f"{name}.so"), os.path.join(build_dir, "splitserve.stamp")
    try:
        with open(stamp) as f:
            if f.read() != _stamp(isa) or not os.path.exists(library):
                return None
    except OSError:
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(build_dir: str, isa: str):
    """Build (or check) through torch, then record the stamp for later processes."""
    import time

    from torch.utils.cpp_extension import load_inline

    lock = os.path.join(build_dir, "lock")
    try:
        if time.time() - os.path.getmtime(lock) > _STALE_LOCK_S:  # its holder died long ago
            log.warning("removing the stale build lock %s", lock)
            os.unlink(lock)
    except OSError:
        pass
    module = load_inline(
        name=module_name(isa),
        cpp_sources=[_SOURCE],
        extra_cflags=list(ISA_CFLAGS[isa]),  # torch appends to them
        extra_ldflags=list(_LDFLAGS),
        build_directory=build_dir,
        verbose=False,
    )
    tmp = os.path.join(build_dir, f"splitserve.stamp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(_stamp(isa))
    os.replace(tmp, os.path.join(build_dir, "splitserve.stamp"))
    return module


def build_isa(isa: str):
    """The compiled module for one instruction set (built once per machine, then imported)."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = _get_build_directory(module_name(isa), verbose=False)
    return _import_built(build_dir, isa) or _build(build_dir, isa)


def load():
    """The compiled module for chosen_isa(), or None when it cannot be built here (logged once)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("SPLITSERVE_CPU_KERNELS", "1") in ("0", "false", "off"):
        return None
    isa = chosen_isa()  # a bad SPLITSERVE_CPU_ISA is an error, not a silent fallback
    try:
        _module = build_isa(isa)
        log.info("CPU ops: %s build", _module.isa())
    except Exception as exc:  # no compiler, no ninja: the torch path still works
        log.warning("CPU ops unavailable (%s); using the torch path", exc)
        _module = None
    return _module


def for_tensor(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)):
    """This module when `x` is a CPU tensor of one of `dtypes` and the ops are built, else None.
    The elementwise ops take float32; the decode attention also float64."""
    if x.device.type != "cpu" or x.dtype not in dtypes:
        return None
    return sys.modules[__name__] if load() is not None else None


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q (B, Hq, D) -> (B, Hq, D) (float32 or float64; call load() first, it must not be None)."""
    return _module.paged_decode(
        q.contiguous(),
        k_cache,
        v_cache,
        block_tables.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        float(scale),
    )


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x (..., H): out, or (out, x + residual) with `residual`; HF Llama numerics in float32."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    res = _module.rms_norm(x2, None if residual is None else residual.reshape(-1, shape[-1]), weight, float(eps))
    if residual is None:
        return res[0].view(shape)
    return res[0].view(shape), res[1].view(shape)


def rotary_cpu(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Neox RoPE in place on q (T, Hq, D) and k (T, Hkv, D); cos_sin_cache (P, D) = cat(cos, sin)."""
    _module.rotary(positions.to(torch.int64).contiguous(), q, k, cos_sin_cache.contiguous())


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """(T, 2F) = [gate | up] -> silu(gate) * up (T, F)."""
    return _module.silu_and_mul(x)


def write_kv_cpu(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter key/value (T, Hkv, D) into the caches (N, bs, Hkv, D) at their slots (< 0 skipped)."""
    _module.write_kv(key, value, k_cache, v_cache, slot_mapping.to(torch.int64).contiguous())


def random_uniform_cpu(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys (B, 2) int64, each in [0, 2**32) -> (B, vocab_size) float32 in (0, 1) (see the module docstring)."""
    return _module.random_uniform(keys, int(vocab_size))
