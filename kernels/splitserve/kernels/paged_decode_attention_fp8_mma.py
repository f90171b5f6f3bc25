"""Paged decode attention over an fp8 (e4m3) cache without shared memory in the loop (the default for e4m3 caches:
docs/performance.md, "Findings that set defaults", fp8 decode attention).

Why a CUDA kernel: the Triton variants convert each e4m3 tile to 16 bits in registers, then go through shared
memory to reach the dot's operand layout, and reduce each tile's softmax across the program's warps. Here each
thread loads its K and V words from global memory in an order that the f16 `mma.sync.m16n8k16` fragments can take
after an in-register convert, and each warp runs its own online softmax over its own 32-token tiles:

    S   (16 query rows x 8 tokens) = q (16 x 16 dims) . K^T (16 dims x 8 tokens)     per 16 dims, per 8 tokens
    O^T (16 dims x 8 query rows)  += V^T (16 dims x 16 tokens) . P^T (16 tokens x 8 rows)

- K^T's fragment wants 2 + 2 dims of one token per thread: one word (4 e4m3 bytes) converted by
  `cvt.rn.f16x2.e4m3x2` twice. A dot does not care in which order its dims come, so each thread's words are
  16-byte runs of the row (one load each), and q is loaded in the same order.
- P^T's fragment wants 2 + 2 tokens of one query row per thread: S's accumulators already hold them (two tokens
  of each of two neighbouring 8-token tiles), so P goes from the softmax to the dot without a shuffle, the
  tokens of a 16-token step taken in that order.
- V^T's fragment wants 2 + 2 tokens of one dim per thread: each thread loads its tokens' runs of V (its D / 8
  dims, one 16-byte load a token at D 128), transposes 4 x 4 bytes at a time with byte permutes (8 `prmt` per
  4 words), then converts. Output dims come out in that order too and are stored through it.
- q and P enter the dots in f16: q in log2 units (the softmax scale folded in), P in [0, 1].
- Query rows: the group's Hq / Hkv heads, at most 8 (S's rows 8-15 and O^T's columns past the group are zero).
- The softmax's denominator is one more product, a row of ones times P^T: the sum of the weights exactly as
  the dot used them (f16), so a V equal for every token comes back exactly.
- Each warp takes every WARPS-th 32-token tile of the (sequence, KV head, split): the whole tiles without masks,
  then the split's last, partial one with them; the warps merge their (m, l, acc) through shared memory at the
  end and write the output, or the split's partial in the format paged_decode_attention.py's merge kernel reads.
  A one-warp program has nothing to merge: each thread writes what it holds from its registers (EPI: faster;
  docs/performance.md, "Findings that set defaults").
- Not e4m3 dots: on sm_90 ptxas lowers `mma.sync` with e4m3 operands to the same converts plus two f16 HMMAs
  (Hopper's e4m3 tensor-core path is wgmma, whose operands come from shared memory), so f16 dots cost no more and
  keep q and P at 11 bits.

Compiled at first use with NVRTC (`torch.cuda._compile_kernel`), per head dim, group, q dtype, page size class and
options; `available()` says whether this build and device can (CUDA, capability >= 8.9, NVRTC through torch).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from splitserve.kernels._common import num_sms
from splitserve.kernels.pdl import pdl_launch

log = logging.getLogger("splitserve.kernels.fp8_mma")

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
#define NT (TILE / 8)       // 8-token n-tiles of S a tile
#define NV (TILE / 4)       // V tokens per thread a tile
#define NS (TILE / 16)      // k16 steps of O^T a tile
#define KW (HEAD_DIM / 16)   // K words per token per thread (its HEAD_DIM / 4 dims)
#define VW (HEAD_DIM / 32)   // V words per token per thread (its HEAD_DIM / 8 dims)
#define MT (HEAD_DIM / 16)   // O^T m-tiles (16 dims each)
#define NEG (-1.0e30f)
#define ONES 0x3C003C00u     // two f16 1.0

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel)); return d;
}
// 4 e4m3 bytes -> two f16x2: lo = bytes 0, 1; hi = bytes 2, 3 (the lower byte in the lower half)
__device__ __forceinline__ void unpack(u32 w, u32 &lo, u32 &hi) {
  asm("{ .reg .b16 a, b; mov.b32 {a, b}, %2; cvt.rn.f16x2.e4m3x2 %0, a; cvt.rn.f16x2.e4m3x2 %1, b; }"
      : "=r"(lo), "=r"(hi) : "r"(w));
}
// two floats -> f16x2 (x0 in the lower half)
__device__ __forceinline__ u32 f16x2(float x0, float x1) {
  u32 d; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(x1), "f"(x0)); return d;
}
__device__ __forceinline__ float ex2(float x) {
  float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}
// the low / high 16-bit value of a word of q (bf16 or f16) as a float
__device__ __forceinline__ float half_lo(u32 h) {
#if Q_BF16
  return __uint_as_float(h << 16);
#else
  float f; asm("{ .reg .b16 a, b; mov.b32 {a, b}, %1; cvt.f32.f16 %0, a; }" : "=f"(f) : "r"(h)); return f;
#endif
}
__device__ __forceinline__ float half_hi(u32 h) {
#if Q_BF16
  return __uint_as_float(h & 0xFFFF0000u);
#else
  float f; asm("{ .reg .b16 a, b; mov.b32 {a, b}, %1; cvt.f32.f16 %0, b; }" : "=f"(f) : "r"(h)); return f;
#endif
}
__device__ __forceinline__ unsigned short to_out(float f) {
  unsigned short h;
#if Q_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
  return h;
}
__device__ __forceinline__ void mma(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// the 4 x 4 byte transpose: out_i byte j = in_j byte i
__device__ __forceinline__ void transpose4(u32 w0, u32 w1, u32 w2, u32 w3, u32 &o0, u32 &o1, u32 &o2, u32 &o3) {
  u32 x = prmt(w0, w1, 0x5140), y = prmt(w2, w3, 0x5140);
  u32 z = prmt(w0, w1, 0x7362), u = prmt(w2, w3, 0x7362);
  o0 = prmt(x, y, 0x5410); o1 = prmt(x, y, 0x7632);
  o2 = prmt(z, u, 0x5410); o3 = prmt(z, u, 0x7632);
}
template <int N> __device__ __forceinline__ void load_words(u32 *w, const unsigned char* p) {
  if (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
      w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      uint2 v = __ldg(reinterpret_cast<const uint2*>(p) + i);
      w[2 * i] = v.x; w[2 * i + 1] = v.y;
    }
  }
}

struct Tile {
  u32 k[NT][KW];  // K words of tokens 8 nt + g: dims 64 (w >> 2) + 16 t + 4 (w & 3) + 0..3
  u32 v[NV][VW];  // V words of tokens 8 (j >> 1) + 2 t + (j & 1): dims (D / 8) g + 4 i + 0..3
};

// The tile's tokens base + x, x = 0..31: block id from lane x (table entry clamped into the sequence: a token
// past the end reads the last block's bytes, then is masked), slot x & page_mask (tiles start at multiples of 32
// and pages are at most 32 tokens: SMALL_PAGE) or (base & page_mask) + x (pages of 32 and more: one block a tile).
// The shuffles run in every lane; `valid` (the same in the whole warp) only gates the loads.
struct Cache {
  const unsigned char* k_thread;  // + this program's KV head and this thread's first dim
  const unsigned char* v_thread;
  int stride_kb, stride_kt, stride_vb, stride_vt, page_mask;
};

__device__ __forceinline__ int slot_of(int base, int x, int page_mask) {
#if SMALL_PAGE
  return x & page_mask;
#else
  return (base & page_mask) + x;
#endif
}

__device__ __forceinline__ void load_k(Tile &T, const Cache &C, int bid, int base, bool valid) {
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int x = 8 * nt + g;
    const int blk = __shfl_sync(0xffffffffu, bid, x);
    const unsigned char* row = C.k_thread + (u64)(unsigned)blk * (u64)(unsigned)C.stride_kb
                               + (unsigned)(slot_of(base, x, C.page_mask) * C.stride_kt);
    if (valid) {
#pragma unroll
      for (int c = 0; c < HEAD_DIM / 64; ++c) load_words<4>(&T.k[nt][4 * c], row + 64 * c);
    }
  }
}

__device__ __forceinline__ void load_v(Tile &T, const Cache &C, int bid, int base, bool valid) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int x = 8 * (j >> 1) + 2 * t + (j & 1);
    const int blk = __shfl_sync(0xffffffffu, bid, x);
    const unsigned char* row = C.v_thread + (u64)(unsigned)blk * (u64)(unsigned)C.stride_vb
                               + (unsigned)(slot_of(base, x, C.page_mask) * C.stride_vt);
    if (valid) load_words<VW>(T.v[j], row);
  }
}

// One 32-token tile into the warp's (m, lsum, acc). LOAD_NEXT: the warp's next tile (at nbase, its block ids in nbid)
// is loaded into T as this one frees it: its K after S = q K^T, its V after O^T += V^T P^T.
template <bool MASK, bool LOAD_NEXT>
__device__ __forceinline__ void attend_tile(
    Tile &T, const u32 (&qa)[KW][2], int base, int end, int g, int t, float &m, float (&lsum)[4],
    float (&acc)[MT][4], const Cache &C, bool has_next, int nbid, int nbase) {
  // S = q K^T over the tile's 8-token n-tiles, one k16 step per K word
  float s[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int w = 0; w < KW; ++w) {
      u32 b0, b1;
      unpack(T.k[nt][w], b0, b1);
      mma(s[nt], qa[w][0], 0u, qa[w][1], 0u, b0, b1);
    }
  }
  if (LOAD_NEXT) load_k(T, C, nbid, nbase, has_next);
  // online softmax of row g over its tokens 8 nt + 2 t + {0, 1}
  float mx = NEG;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (MASK && base + 8 * nt + 2 * t + i >= end) s[nt][i] = NEG;
      mx = fmaxf(mx, s[nt][i]);
    }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m, mx);
  const float alpha = ex2(m - m_new);
  m = m_new;
  // P^T fragments of k16 step st: tokens 16 st + 2 t + {0, 1} (b0) and 16 st + 8 + 2 t + {0, 1} (b1)
  u32 pb[NS][2];
#pragma unroll
  for (int st = 0; st < NS; ++st)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int nt = 2 * st + h;
      pb[st][h] = (GROUP == 8 || g < GROUP) ? f16x2(ex2(s[nt][0] - m_new), ex2(s[nt][1] - m_new)) : 0u;
    }
  // rescale O^T's columns (query rows 2t, 2t+1: their alpha lives in lanes 8t and 8t+4)
  const float a_lo = __shfl_sync(0xffffffffu, alpha, 8 * t);
  const float a_hi = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    acc[mt][0] *= a_lo; acc[mt][1] *= a_hi; acc[mt][2] *= a_lo; acc[mt][3] *= a_hi;
  }
  lsum[0] *= a_lo; lsum[1] *= a_hi; lsum[2] *= a_lo; lsum[3] *= a_hi;
  if (MASK) {  // a slot past the sequence may hold NaN bytes, and NaN x 0 is NaN
#pragma unroll
    for (int j = 0; j < NV; ++j)
      if (base + 8 * (j >> 1) + 2 * t + (j & 1) >= end) {
#pragma unroll
        for (int i = 0; i < VW; ++i) T.v[j][i] = 0u;
      }
  }
  // O^T += V^T P^T: a token's word i holds dims (D / 8) g + 4 i + 0..3 = rows g, g + 8 of m-tile 2 i (bytes 0,
  // 1) and of m-tile 2 i + 1 (bytes 2, 3); k16 step st takes tokens j = 4 st .. 4 st + 3
#pragma unroll
  for (int st = 0; st < NS; ++st) {
    mma(lsum, ONES, ONES, ONES, ONES, pb[st][0], pb[st][1]);
#pragma unroll
    for (int i = 0; i < VW; ++i) {
      u32 d0, d1, d2, d3;  // dim 4 i + e of tokens j = 4 st .. 4 st + 3, one byte each
      transpose4(T.v[4 * st][i], T.v[4 * st + 1][i], T.v[4 * st + 2][i], T.v[4 * st + 3][i], d0, d1, d2, d3);
      u32 a0, a2, a1, a3;
      unpack(d0, a0, a2);
      unpack(d1, a1, a3);
      mma(acc[2 * i], a0, a1, a2, a3, pb[st][0], pb[st][1]);
      unpack(d2, a0, a2);
      unpack(d3, a1, a3);
      mma(acc[2 * i + 1], a0, a1, a2, a3, pb[st][0], pb[st][1]);
    }
  }
  if (LOAD_NEXT) load_v(T, C, nbid, nbase, has_next);
}

// One (sequence, KV head) of a program: where its split's tokens are, and this warp's first tile.
struct Unit {
  int b, kvh, start, end, num_tiles, num_full, first_base, first_bid;
  const int* bt_row;
  bool live;  // a sequence of the batch (a program's last SEQS may run past it)
};

__device__ __forceinline__ int unit_seq(int u) { return blockIdx.y * SEQS + u / HEADS; }

// unit u given its sequence's length (read a unit earlier, so that the table read here does not wait for it)
__device__ __forceinline__ Unit unit_of(int u, int seq_len, const int* bt, int stride_btb, int num_seqs,
                                        int num_splits, int page_shift) {
  Unit U;
  U.b = unit_seq(u);
  U.kvh = blockIdx.x * HEADS + u % HEADS;
  U.live = U.b < num_seqs;
  const int per_split = ((seq_len + num_splits - 1) / num_splits + TILE - 1) / TILE * TILE;
  U.start = blockIdx.z * per_split;
  U.end = min(U.start + per_split, seq_len);
  U.num_tiles = U.end > U.start ? (U.end - U.start + TILE - 1) / TILE : 0;
  U.num_full = U.end > U.start ? (U.end - U.start) / TILE : 0;
  U.bt_row = bt + (u64)(U.live ? U.b : 0) * stride_btb;
  U.first_base = U.start + (threadIdx.x >> 5) * TILE;
  U.first_bid = U.num_tiles > 0
      ? __ldg(U.bt_row + (max(min(U.first_base + (int)(threadIdx.x & 31), U.end - 1), 0) >> page_shift)) : 0;
  return U;
}

__device__ __forceinline__ int seq_len_of(int u, const int* seq_lens, int num_seqs) {
  const int b = unit_seq(u);
  return u < HEADS * SEQS && b < num_seqs ? __ldg(seq_lens + b) : 0;
}

// this thread's 16-byte runs of q row g (query head kvh GROUP + g): dims 64 c + 16 t + 0..15, c < HEAD_DIM / 64
struct QRaw { uint4 x[HEAD_DIM / 32]; };

__device__ __forceinline__ void load_q(QRaw &R, const unsigned short* q, const Unit &U, int stride_qb,
                                       int stride_qh, int g, int t) {
  const unsigned short* qrow = q + (u64)U.b * stride_qb + (u64)(U.kvh * GROUP + min(g, GROUP - 1)) * stride_qh;
#pragma unroll
  for (int c = 0; c < HEAD_DIM / 64; ++c) {
    const uint4* src = reinterpret_cast<const uint4*>(qrow + 64 * c + 16 * t);
    R.x[2 * c] = U.live ? __ldg(src) : make_uint4(0u, 0u, 0u, 0u);
    R.x[2 * c + 1] = U.live ? __ldg(src + 1) : make_uint4(0u, 0u, 0u, 0u);
  }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
splitserve_fp8_decode(
    const unsigned short* __restrict__ q, const unsigned char* __restrict__ kc, const unsigned char* __restrict__ vc,
    const int* __restrict__ bt, const int* __restrict__ seq_lens, unsigned short* __restrict__ out,
    float* __restrict__ part_acc, float* __restrict__ part_ml,
    int num_splits, int page_shift, int num_q_heads, int num_seqs,
    int stride_qb, int stride_qh, int stride_kb, int stride_kt, int stride_kh,
    int stride_vb, int stride_vt, int stride_vh, int stride_btb, int stride_ob, int stride_oh, double qk_scale_d) {
  __shared__ float sm_ml[WARPS][2][8];
  __shared__ float sm_acc[WARPS][8][HEAD_DIM];
#if PDL
  // programmatic dependent launch (kernels/pdl.py): wait for the kernel before (q, the new token's K and V), then
  // let the one after be scheduled
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  const int split = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int page_mask = (1 << page_shift) - 1;
  // a thread's K and V words of KV head h start at these + h * stride_kh / stride_vh
  const unsigned char* k_thread = kc + 16 * t;
  const unsigned char* v_thread = vc + (HEAD_DIM / 8) * g;
  // the program's HEADS x SEQS (sequence, KV head) units, heads inner. Each warp's first tile of the next unit is
  // loaded during its last tile of this one (AHEAD), the next unit's q and block table entry at this one's start,
  // and the length of the one after that too: no unit waits on a chain of dependent loads but the first.
  Unit nu = unit_of(0, seq_len_of(0, seq_lens, num_seqs), bt, stride_btb, num_seqs, num_splits, page_shift);
  int next_len = seq_len_of(1, seq_lens, num_seqs);
  QRaw qn;
  load_q(qn, q, nu, stride_qb, stride_qh, g, t);
  Tile T;
#if AHEAD
  {
    const Cache C0 = {k_thread + (u64)nu.kvh * stride_kh, v_thread + (u64)nu.kvh * stride_vh,
                      stride_kb, stride_kt, stride_vb, stride_vt, page_mask};
    load_k(T, C0, nu.first_bid, nu.first_base, warp < nu.num_tiles);
    load_v(T, C0, nu.first_bid, nu.first_base, warp < nu.num_tiles);
  }
#endif
#pragma unroll 1
  for (int u = 0; u < HEADS * SEQS; ++u) {
    const Unit cu = nu;
    if (!cu.live) break;  // units past the batch are the program's last ones
    const bool more = u + 1 < HEADS * SEQS;
    // q row g (query head kvh GROUP + g) in f16, log2 units, over the dims of this thread's K words: word w's
    // bytes 0, 1 pair with qa[w][0], bytes 2, 3 with qa[w][1]
    u32 qa[KW][2];
    {
      const float sc = g < GROUP ? (float)qk_scale_d : 0.f;
#pragma unroll
      for (int c = 0; c < HEAD_DIM / 64; ++c) {
        const uint4 x = qn.x[2 * c], y = qn.x[2 * c + 1];
        const u32 h[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};  // dims 2 i, 2 i + 1 in h[i] (low half first)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          qa[4 * c + i][0] = f16x2(half_lo(h[2 * i]) * sc, half_hi(h[2 * i]) * sc);
          qa[4 * c + i][1] = f16x2(half_lo(h[2 * i + 1]) * sc, half_hi(h[2 * i + 1]) * sc);
        }
      }
    }
    if (more) {
      nu = unit_of(u + 1, next_len, bt, stride_btb, num_seqs, num_splits, page_shift);
      next_len = seq_len_of(u + 2, seq_lens, num_seqs);
      load_q(qn, q, nu, stride_qb, stride_qh, g, t);
    }
    const int b = cu.b, kvh = cu.kvh, start = cu.start, end = cu.end;

    float m = NEG;                         // row g's running max (log2 units)
    float lsum[4] = {0.f, 0.f, 0.f, 0.f};  // sum of the f16 weights of query rows 2t, 2t+1 (a ones-row product)
    float acc[MT][4];  // O^T: rows = dims (D / 8) g + 2 mt (+ 1 for [2], [3]), columns = query rows 2 t, 2 t + 1
#pragma unroll
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    // each warp takes every WARPS-th tile: the whole ones first, then the split's last, partial one (if any);
    // the tile after the unit's last is the next unit's first (nu: loaded only when it is live and has tiles)
    const Cache C = {k_thread + (u64)kvh * stride_kh, v_thread + (u64)kvh * stride_vh,
                     stride_kb, stride_kt, stride_vb, stride_vt, page_mask};
    const Cache CN = {k_thread + (u64)nu.kvh * stride_kh, v_thread + (u64)nu.kvh * stride_vh,
                      stride_kb, stride_kt, stride_vb, stride_vt, page_mask};
    const bool load_nu = more && nu.live && warp < nu.num_tiles;
    int tile = warp;
    int bid = cu.first_bid;
    for (; tile < cu.num_full; tile += WARPS) {
      const int base = start + tile * TILE;
#if !AHEAD
      load_k(T, C, bid, base, true);
      load_v(T, C, bid, base, true);
#endif
      const int next = tile + WARPS;
      if (next < cu.num_tiles) {
        const int nbase = start + next * TILE;
        const int nbid = __ldg(cu.bt_row + (min(nbase + lane, end - 1) >> page_shift));
        attend_tile<false, AHEAD != 0>(T, qa, base, end, g, t, m, lsum, acc, C, true, nbid, nbase);
        bid = nbid;
      } else {
        attend_tile<false, AHEAD != 0>(T, qa, base, end, g, t, m, lsum, acc, CN, load_nu, nu.first_bid,
                                       nu.first_base);
      }
    }
    if (tile < cu.num_tiles) {
      const int base = start + tile * TILE;
#if !AHEAD
      load_k(T, C, bid, base, true);
      load_v(T, C, bid, base, true);
#endif
      attend_tile<true, (AHEAD != 0 && HEADS * SEQS > 1)>(T, qa, base, end, g, t, m, lsum, acc, CN, load_nu,
                                                          nu.first_bid, nu.first_base);
    }
#if AHEAD
    if (cu.num_tiles <= warp && load_nu) {  // this warp had no tile of the unit: the next one's first still loads
      load_k(T, CN, nu.first_bid, nu.first_base, true);
      load_v(T, CN, nu.first_bid, nu.first_base, true);
    }
#endif

#if EPI && WARPS == 1
    // one warp: nothing to merge, each thread writes what it holds: dims (D / 8) g + 0 .. D / 8 - 1 of query rows
    // 2 t + c (acc[mt][c] and acc[mt][2 + c]: dims (D / 8) g + 2 mt, + 1), their weights' sum lsum[c] and max m
    // (row 2 t + c's, in lane 8 t + 4 c)
    {
      const float m_row[2] = {__shfl_sync(0xffffffffu, m, 8 * t), __shfl_sync(0xffffffffu, m, 8 * t + 4)};
      const int d0 = (HEAD_DIM / 8) * g;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int head = kvh * GROUP + 2 * t + c;
        if (GROUP < 8 && 2 * t + c >= GROUP) continue;
        if (num_splits == 1) {
          const float inv = lsum[c] > 0.f ? 1.f / lsum[c] : 0.f;
          u32 w[MT];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
            w[mt] = (u32)to_out(acc[mt][c] * inv) | ((u32)to_out(acc[mt][2 + c] * inv) << 16);
          unsigned short* o = out + (u64)b * stride_ob + (u64)head * stride_oh + d0;
          if (((u64)o & 15) == 0) {
#pragma unroll
            for (int i = 0; i < MT / 4; ++i)
              reinterpret_cast<uint4*>(o)[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
          } else {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) { o[2 * mt] = (unsigned short)w[mt]; o[2 * mt + 1] = w[mt] >> 16; }
          }
        } else {
          const u64 row = ((u64)b * num_q_heads + head) * num_splits + split;
          float4* pa = reinterpret_cast<float4*>(part_acc + row * HEAD_DIM + d0);
#pragma unroll
          for (int i = 0; i < MT / 2; ++i)
            pa[i] = make_float4(acc[2 * i][c], acc[2 * i][2 + c], acc[2 * i + 1][c], acc[2 * i + 1][2 + c]);
          if (g == 0) { part_ml[row * 2] = m_row[c]; part_ml[row * 2 + 1] = lsum[c]; }
        }
      }
    }
#else
    // merge the warps through shared memory: m per query row, the weights' sum and acc per (row, dim)
    if (t == 0) sm_ml[warp][0][g] = m;
    if (g == 0) { sm_ml[warp][1][2 * t] = lsum[0]; sm_ml[warp][1][2 * t + 1] = lsum[1]; }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int d = (HEAD_DIM / 8) * g + 2 * mt;
      sm_acc[warp][2 * t][d] = acc[mt][0];
      sm_acc[warp][2 * t + 1][d] = acc[mt][1];
      sm_acc[warp][2 * t][d + 1] = acc[mt][2];
      sm_acc[warp][2 * t + 1][d + 1] = acc[mt][3];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < GROUP * HEAD_DIM; e += WARPS * 32) {
      const int h = e / HEAD_DIM, d = e % HEAD_DIM;
      float M = NEG;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) M = fmaxf(M, sm_ml[w][0][h]);
      float L = 0.f, A = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float f = ex2(sm_ml[w][0][h] - M);
        L += f * sm_ml[w][1][h];
        A += f * sm_acc[w][h][d];
      }
      const int head = kvh * GROUP + h;
      if (num_splits == 1) {
        out[(u64)b * stride_ob + (u64)head * stride_oh + d] = to_out(L > 0.f ? A / L : 0.f);
      } else {
        const u64 row = ((u64)b * num_q_heads + head) * num_splits + split;
        part_acc[row * HEAD_DIM + d] = A;
        if (d == 0) { part_ml[row * 2] = M; part_ml[row * 2 + 1] = L; }
      }
    }
    if (more) __syncthreads();  // the next unit's merge writes the same shared memory
#endif
  }
}
"""

# options: WARPS (warps per program, each on its own 32-token tiles), HEADS and SEQS (a program takes HEADS KV heads
# of SEQS sequences, one (sequence, KV head) after the other, heads inner: each warp's first tile of the next is
# loaded during its last tile of the one before), MIN_BLOCKS (programs an SM should hold: __launch_bounds__ caps the
# registers to fit them), AHEAD (load the warp's next tile into the registers this one frees: K after the scores, V
# after the values' dots), TILE (tokens a warp takes at a time: 16 or 32). HEADS / SEQS 2 are no faster, and an L2
# prefetch of each warp's next tile (PF) was slower and removed (docs/performance.md, "mma options removed").
# EPI: one-warp programs write their output (or split partial) straight from the registers, not through the
# shared-memory merge that more warps need (0: the merge for them too)
DEFAULT_OPTIONS = dict(WARPS=0, HEADS=1, SEQS=1, MIN_BLOCKS=1, AHEAD=1, TILE=32, EPI=1)  # WARPS 0: choose_warps
HEAD_DIMS = (64, 128)  # 256: its tile's registers spill (ptxas: 255 and local memory)
MAX_GROUP = 8


def available(device: torch.device | int | None = None) -> bool:
    """CUDA (not ROCm), compute capability >= 8.9, and NVRTC through torch."""
    index = device if isinstance(device, int) or device is None else device.index
    return _available(torch.cuda.current_device() if index is None and torch.cuda.is_available() else index)


@functools.cache
def _available(index: int | None) -> bool:
    if not torch.cuda.is_available() or torch.version.hip or not hasattr(torch.cuda, "_compile_kernel"):
        return False
    return torch.cuda.get_device_capability(index) >= (8, 9)


def supports(q, k_cache, v_cache, out=None, block_tables=None, seq_lens=None) -> str | None:
    """None when this kernel can run these operands, else why not; also, when given, the output (q's dtype, unit
    stride along head_dim), the block tables and the sequence lengths (int32)."""
    if out is not None and (out.dtype != q.dtype or out.stride(-1) != 1):
        return f"the output must be {q.dtype} with unit stride along head_dim"
    for t in (block_tables, seq_lens):
        if t is not None and t.dtype != torch.int32:
            return f"block tables and sequence lengths must be int32, got {t.dtype}"
    head_dim = q.shape[-1]
    group = q.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    if k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != torch.float8_e4m3fn:
        return f"caches are {k_cache.dtype}, not float8_e4m3fn"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q is {q.dtype}, not bfloat16 or float16"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {HEAD_DIMS}"
    if group > MAX_GROUP:
        return f"{group} query heads per KV head (at most {MAX_GROUP})"
    if block_size & (block_size - 1):
        return f"block_size {block_size} is not a power of two"
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return "q, k_cache and v_cache need unit stride along head_dim"
    if q.data_ptr() % 16 or any(s * q.element_size() % 16 for s in q.stride()[:2]):
        return "q's rows must start at 16-byte boundaries"
    for cache in (k_cache, v_cache):
        if any(s % 16 for s in cache.stride()[:3]) or cache.data_ptr() % 16:
            return "cache rows must start at 16-byte boundaries"
    return None


# paged_decode_attention's default for the caches it takes; False: the Triton "rows" variant (benches compare them)
ENABLED = True
# why NVRTC could not build the kernel in this process (a build of torch without it, a driver it does not know):
# set at the first failure, after which runs() says no and the default is the Triton kernel again
FAILED: str | None = None


class CompileError(RuntimeError):
    """NVRTC could not build the kernel here."""


def runs(q, k_cache, v_cache, out=None, block_tables=None, seq_lens=None) -> bool:
    """Whether this kernel takes these operands here (what paged_decode_attention defaults to it on)."""
    return (
        ENABLED
        and FAILED is None
        and k_cache.dtype == torch.float8_e4m3fn
        and available(q.device)
        and supports(q, k_cache, v_cache, out, block_tables, seq_lens) is None
    )


MIN_TOKENS_PER_SPLIT = 512  # pays(): below, a program's start is too large a share of its work


def pays(units: int, sm_count: int, tokens_per_split: int) -> bool:
    """Whether `units` (sequence, KV head, split) programs of at most `tokens_per_split` tokens each (the block
    table's width over the splits: in a CUDA graph the graph's width, not the batch's lengths) are work enough for
    this kernel to beat the Triton rows variant: one program an SM at least, and at least MIN_TOKENS_PER_SPLIT
    tokens a split (docs/performance.md, "Findings that set defaults": `fp8_mma.pays`)."""
    return units >= sm_count and tokens_per_split >= MIN_TOKENS_PER_SPLIT


def choose_warps(units: int, sm_count: int) -> int:
    """Warps a program for `units` (sequence, KV head, split) triples: each warp takes its own tiles, so
    fewer warps a program means longer runs per warp; more are needed only to fill the GPU
    (docs/performance.md, "Findings that set defaults": `choose_warps`)."""
    if units >= 8 * sm_count:
        return 1
    return 2 if units >= 2 * sm_count else 4


@functools.cache
def _kernel(head_dim: int, group: int, q_bf16: bool, small_page: bool, pdl: bool, options: tuple):
    defines = dict(HEAD_DIM=head_dim, GROUP=group, Q_BF16=int(q_bf16), SMALL_PAGE=int(small_page), PDL=int(pdl))
    source = "".join(f"#define {k} {v}\n" for k, v in {**defines, **dict(options)}.items()) + SOURCE
    global FAILED
    try:
        kernel = torch.cuda._compile_kernel(source, "splitserve_fp8_decode")
    except Exception as exc:  # any failure of the toolchain: the caller falls back, once, loudly
        FAILED = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        log.warning("the fp8 mma decode attention could not be compiled (%s); using the Triton kernel", FAILED)
        raise CompileError(f"paged_decode_attention_fp8_mma: NVRTC failed: {FAILED}") from exc
    return _Launcher(kernel, num_pointers=8, num_ints=15, pdl=pdl)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte value union at offset 8
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _Launcher:
    """cuLaunchKernel through ctypes with the argument slots built once: each launch writes the new values into
    them (torch's own launcher rebuilds every argument per call: tens of microseconds a launch in Python). With
    `pdl`, cuLaunchKernelEx with programmatic stream serialization allowed (the kernel was built with PDL 1)."""

    def __init__(self, kernel, num_pointers: int, num_ints: int, pdl: bool = False) -> None:
        from torch.cuda._utils import _get_gpu_runtime_library

        driver = _get_gpu_runtime_library()
        self.func = kernel.func
        self.launch = driver.cuLaunchKernel
        self.pointers = [ctypes.c_void_p() for _ in range(num_pointers)]
        self.ints = [ctypes.c_int() for _ in range(num_ints)]
        self.double = ctypes.c_double()
        slots = [*self.pointers, *self.ints, self.double]
        self.args = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(v) for v in slots])
        self.launch_ex = getattr(driver, "cuLaunchKernelEx", None)  # drivers of CUDA 11.8+
        self.pdl = pdl and self.launch_ex is not None  # without: griddepcontrol.wait returns at once
        if self.pdl:
            self.attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
            self.attr.value[0] = 1
            self.config = _LaunchConfig(attrs=ctypes.pointer(self.attr), num_attrs=1)

    def __call__(self, grid, block, pointers, ints, double) -> None:
        for slot, value in zip(self.pointers, pointers):
            slot.value = value
        for slot, value in zip(self.ints, ints):
            slot.value = value
        self.double.value = double
        stream = torch.cuda.current_stream().cuda_stream
        result = None
        if self.pdl:
            config = self.config
            config.grid[:] = grid
            config.block[:] = block
            config.stream = stream
            result = self.launch_ex(ctypes.byref(config), self.func, self.args, None)
            if result != 0:  # a driver that takes no PDL launch: plain launches from now on (the wait is a no-op)
                log.warning("cuLaunchKernelEx with PDL failed (CUDA error %s); launching without PDL", result)
                self.pdl = False
        if not self.pdl:
            result = self.launch(self.func, *grid, *block, 0, ctypes.c_void_p(stream), self.args, None)
        if result != 0:
            raise RuntimeError(f"paged_decode_attention_fp8_mma: cuLaunchKernel failed with CUDA error {result}")


def launch_fp8_mma(q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_ml, qk_scale, num_splits, cfg):
    """Launch the kernel over grid (KV heads / HEADS, sequences / SEQS, split); cfg may set DEFAULT_OPTIONS' keys.
    With num_splits > 1
    the partials go to part_acc / part_ml for the merge kernel (paged_decode_attention.py)."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    opts = {k: int(cfg.get(k, v)) for k, v in DEFAULT_OPTIONS.items()}
    sms = num_sms(q.device.index or 0)
    if opts["HEADS"] < 1 or num_kv_heads % opts["HEADS"]:
        raise ValueError(f"paged_decode_attention: VARIANT 'mma' HEADS {opts['HEADS']} does not divide {num_kv_heads}")
    if opts["SEQS"] < 1:
        raise ValueError(f"paged_decode_attention: VARIANT 'mma' SEQS must be at least 1, got {opts['SEQS']}")
    if opts["WARPS"] == 0:
        opts["WARPS"] = choose_warps(batch * num_kv_heads * num_splits, sms)
    group = num_q_heads // num_kv_heads
    if opts["TILE"] not in (16, 32):
        raise ValueError(f"paged_decode_attention: VARIANT 'mma' takes TILE 16 or 32, got {opts['TILE']}")
    # pages no longer than a tile: a token's slot is fixed by its place in the tile (tiles start at multiples of it)
    pdl = pdl_launch(q)["PDL"]  # programmatic dependent launch where the Triton kernels use it (capability 9.0+)
    kernel = _kernel(
        head_dim, group, q.dtype == torch.bfloat16, block_size <= opts["TILE"], pdl, tuple(sorted(opts.items()))
    )
    kernel(
        (num_kv_heads // opts["HEADS"], -(-batch // opts["SEQS"]), num_splits),
        (opts["WARPS"] * 32, 1, 1),
        [
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            part_acc.data_ptr(),
            part_ml.data_ptr(),
        ],  # fmt: skip
        [
            num_splits,
            block_size.bit_length() - 1,
            num_q_heads,
            batch,
            q.stride(0),
            q.stride(1),
            *k_cache.stride()[:3],
            *v_cache.stride()[:3],
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
        ],  # fmt: skip
        float(qk_scale),
    )
