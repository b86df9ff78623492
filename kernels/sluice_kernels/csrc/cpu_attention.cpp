// Paged decode attention for the CPU shard: float32 queries and outputs over
// a float32 or bfloat16 KV cache (bf16 K/V rows are widened to float32 as
// they are read, exactly: a bf16 is the upper half of a float32).
//
// One new token per sequence attends to its context, read straight from the
// paged KV cache through the block table: no gather of the context into a
// contiguous copy, and each K and V row is read once per step and KV head
// (the G = Hq / Hkv query heads that share a KV head are served together).
//
// The keys of sequence b are [first, len): first is 0, or with a sliding
// window W > 0 the window's first key, max(0, len - W) (the new token sees
// its last W keys, itself included).
//
// Work items are (sequence b, kv head h, context part p): a step of one
// sequence still keeps every core busy by cutting its keys into parts of
// PART tokens, each reduced with its own softmax maximum and then merged
// (split-KV, as flash-decoding does):
//
//   item (b, h, p), keys [t0, t1):
//     s[g, t] = scale * q[b, h*G + g] . K[t, h]
//     m[g] = max_t s[g, t];  l[g] = sum_t e^(s - m);  a[g, :] = sum_t e^(s - m) V[t, h]
//   merge over p:  M = max_p m_p;  out[b, h*G + g] = sum_p e^(m_p - M) a_p / sum_p e^(m_p - M) l_p
//
// With attention sinks (gpt-oss: one logit per query head), the merge's
// denominator has one more term, e^(sink - M), M then also over the sink.
//
// Parts depend on the sequence's own keys alone, so its result is bitwise
// the same whatever else is in the step.
//
// Token t of sequence b lives in block tables[b, t / BS] at offset t % BS;
// the cache is [num_blocks, BS, Hkv, D], so the rows of one block are
// Hkv * D elements apart.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "sluice_cpu.h"

namespace {

// e^x for x <= 0 (softmax after the maximum is subtracted), written so the
// compiler vectorizes loops over it: Cody-Waite reduction x = n ln2 + r, a
// degree-6 polynomial for e^r (Cephes' expf, about 1 ulp), 2^n from the
// exponent bits.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// s[t] = e^(s[t] - m) for the n scores of one head (m their maximum);
// returns their sum, the softmax's denominator for this part.
inline float exp_scores(float* s, int64_t n, float m) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_nonpositive(s[t] - m);
    sum += s[t];
  }
  return sum;
}

// Keys per context part. Fixed, so a sequence's parts (and its result, bit
// for bit) depend on its own keys alone; a one-sequence step of a 1,000-key
// context still has 8 x Hkv items for the threads.
constexpr int64_t PART = 128;

struct Partial {
  float* m;    // [G]
  float* l;    // [G]
  float* acc;  // [G, D]
};

// A cache element as float32.
inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

// Where one work item reads: K/V rows of one kv head, keys [t0, t1); T is
// the cache's element type.
template <typename T>
struct Keys {
  const T* k;  // the caches, offset to this kv head
  const T* v;
  const int64_t* table;
  int64_t t0, t1, BS, token_stride, block_stride;

  // Where key t0 + i sits in either cache (elements from the head's start),
  // for i in [0, t1 - t0): one division for the first key, then block by
  // block (a division per key and phase cost more than the key's arithmetic).
  void offsets(int64_t* at) const {
    int64_t j = t0 / BS, slot = t0 % BS;
    for (int64_t i = 0; i < t1 - t0; ++i) {
      at[i] = table[j] * block_stride + slot * token_stride;
      if (++slot == BS) {
        slot = 0;
        ++j;
      }
    }
  }
};

// Asks for a cache row (D elements) ahead of its use. A kv head's row is a
// few cache lines, the next row is a token stride away and the next block
// anywhere in the cache: the hardware prefetchers do not follow, and without
// this the kernel waited on memory for most of its time (2.2x slower for 32
// sequences of 300 keys, benchmarks/cpu_attention_bench.py).
template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

// Keys ahead of the one in use that the portable loops prefetch.
constexpr int64_t AHEAD = 8;

// The portable version of one work item (any D, any G).
template <typename T>
void attend_part_generic(const float* __restrict q, const Keys<T>& keys, int64_t G, int64_t D, float scale,
                         std::vector<float>& scores, const Partial& out) {
  const int64_t n = keys.t1 - keys.t0;
  scores.resize(G * n);
  int64_t at[PART];
  keys.offsets(at);
  for (int64_t g = 0; g < G; ++g) out.m[g] = -std::numeric_limits<float>::infinity();
  for (int64_t t = keys.t0; t < keys.t1; ++t) {
    const T* row = keys.k + at[t - keys.t0];
    if (t + AHEAD < keys.t1) prefetch_row(keys.k + at[t + AHEAD - keys.t0], D);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < D; ++i) dot += qg[i] * widen(row[i]);
      const float sc = dot * scale;
      scores[g * n + t - keys.t0] = sc;
      out.m[g] = std::max(out.m[g], sc);
    }
  }
  for (int64_t g = 0; g < G; ++g) out.l[g] = exp_scores(scores.data() + g * n, n, out.m[g]);
  std::fill(out.acc, out.acc + G * D, 0.f);
  for (int64_t t = keys.t0; t < keys.t1; ++t) {
    const T* row = keys.v + at[t - keys.t0];
    if (t + AHEAD < keys.t1) prefetch_row(keys.v + at[t + AHEAD - keys.t0], D);
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * n + t - keys.t0];
      float* a = out.acc + g * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) a[i] += w * widen(row[i]);
    }
  }
}

#if defined(__AVX512F__)
// 16 cache elements as float32: a bf16 widens by moving its 16 bits to the
// top of a 32-bit lane.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The 16 lane sums of v[0..16), in order: three rounds of pairwise shuffles
// and adds (the lanes of two vectors folded into one), then one permute,
// about 3 instructions per vector instead of a full horizontal sum each.
inline __m512 sum16(__m512 v[16]) {
  __m512 r[8], s[4], u[2];
  for (int j = 0; j < 8; ++j)  // r_j: v_2j's 8 pair sums in lanes 0-7, v_2j+1's in 8-15
    r[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // s_k: quarter q holds token 4k + q's 4 partial sums
    s[k] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * k], r[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(r[2 * k], r[2 * k + 1], 0xDD));
  for (int m = 0; m < 2; ++m)  // u_m: quarter q holds tokens 8m + q (lanes 0-1), 8m + 4 + q (2-3)
    u[m] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * m], s[2 * m + 1], 0x44),
                         _mm512_shuffle_ps(s[2 * m], s[2 * m + 1], 0xEE));
  // w: lane 4q + j holds token 4j + q
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, w);
}

inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                        _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// One work item with DV = D / 16 vectors per head row and GB query rows at a
// time (GB * DV <= 16 registers of queries, then of accumulators).
template <typename T, int DV, int GB>
void attend_part_avx512(const float* __restrict q, const Keys<T>& keys, int64_t G, float scale, float* scores,
                        const Partial& out) {
  constexpr int64_t D = DV * 16;
  const int64_t n = keys.t1 - keys.t0;  // <= PART
  int64_t at[PART];
  keys.offsets(at);
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const int gb = static_cast<int>(std::min<int64_t>(GB, G - g0));
    __m512 qv[GB][DV];
    for (int g = 0; g < gb; ++g)
      for (int c = 0; c < DV; ++c) qv[g][c] = _mm512_mul_ps(_mm512_loadu_ps(q + (g0 + g) * D + 16 * c),
                                                           _mm512_set1_ps(scale));
    // Scores, 16 keys at a time (the last group padded with zero rows).
    __m512 mx[GB];
    for (int g = 0; g < gb; ++g) mx[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t i0 = 0; i0 < n; i0 += 16) {
      const int64_t cnt = std::min<int64_t>(16, n - i0);
      __m512 part[GB][16];
      for (int64_t i = 0; i < 16; ++i) {
        if (i >= cnt) {
          for (int g = 0; g < gb; ++g) part[g][i] = _mm512_setzero_ps();
          continue;
        }
        const T* row = keys.k + at[i0 + i];
        if (g0 == 0) {  // the next group's keys, and this key's value
          if (i0 + 16 + i < n) prefetch_row(keys.k + at[i0 + 16 + i], D);
          prefetch_row(keys.v + at[i0 + i], D);
        }
        __m512 kv[DV];
        for (int c = 0; c < DV; ++c) kv[c] = load16(row + 16 * c);
        for (int g = 0; g < gb; ++g) {
          __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
          for (int c = 1; c < DV; ++c) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);
          part[g][i] = a;
        }
      }
      const __mmask16 valid = static_cast<__mmask16>(cnt == 16 ? 0xFFFF : (1u << cnt) - 1);
      for (int g = 0; g < gb; ++g) {
        const __m512 s = sum16(part[g]);
        _mm512_storeu_ps(scores + g * PART + i0, s);
        mx[g] = _mm512_mask_max_ps(mx[g], valid, mx[g], s);
      }
    }
    // e^(s - m) and the sums; padded lanes become 0.
    for (int g = 0; g < gb; ++g) {
      const float m = _mm512_reduce_max_ps(mx[g]);
      const __m512 mv = _mm512_set1_ps(m);
      __m512 sum = _mm512_setzero_ps();
      float* sg = scores + g * PART;
      for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int64_t cnt = std::min<int64_t>(16, n - i0);
        const __mmask16 valid = static_cast<__mmask16>(cnt == 16 ? 0xFFFF : (1u << cnt) - 1);
        const __m512 e = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sg + i0), mv)));
        _mm512_storeu_ps(sg + i0, e);
        sum = _mm512_add_ps(sum, e);
      }
      out.m[g0 + g] = m;
      out.l[g0 + g] = _mm512_reduce_add_ps(sum);
    }
    // Values, accumulators in registers.
    __m512 acc[GB][DV];
    for (int g = 0; g < gb; ++g)
      for (int c = 0; c < DV; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const T* row = keys.v + at[i];
      __m512 vv[DV];
      for (int c = 0; c < DV; ++c) vv[c] = load16(row + 16 * c);
      for (int g = 0; g < gb; ++g) {
        const __m512 w = _mm512_set1_ps(scores[g * PART + i]);
        for (int c = 0; c < DV; ++c) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
      }
    }
    for (int g = 0; g < gb; ++g)
      for (int c = 0; c < DV; ++c) _mm512_storeu_ps(out.acc + (g0 + g) * D + 16 * c, acc[g][c]);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// 8 cache elements as float32 (a bf16 widened as load16 does).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The 8 lane sums of v[0..8), in order: two rounds of HADD leave each
// vector's sums of lanes 0-3 and 4-7 in the two 128-bit halves, one add
// across the halves finishes them.
inline __m256 sum8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// One work item on AVX2 hosts, for D = 8 * DV (DV a multiple of 8): the
// generic loops reduce every key's dot product horizontally and widen a
// bfloat16 row once per query head; here each key row is widened once per
// item, its dot products with up to 8 query heads (scaled beforehand, as the
// AVX-512 kernel's are) stay vectors until 8 keys' are folded at once
// (sum8), and the values are accumulated 64 dimensions at a time in
// registers against rows widened once into a float32 copy.
template <typename T, int DV>
void attend_part_avx2(const float* __restrict q, const Keys<T>& keys, int64_t G, float scale,
                      std::vector<float>& scratch, const Partial& out) {
  static_assert(DV % 8 == 0, "whole runs of 64 dimensions");
  constexpr int64_t D = DV * 8;
  constexpr bool widen_rows = !std::is_same_v<T, float>;
  const int64_t n = keys.t1 - keys.t0;  // <= PART
  // scores [G][PART], q * scale [G][D], a row's dot vectors [8 keys][8 heads][8], values as float32 [PART][D]
  scratch.resize(G * PART + G * D + 64 * 8 + (widen_rows ? PART * D : 0));
  float* scores = scratch.data();
  float* qs = scores + G * PART;
  float* dots = qs + G * D;
  float* values = dots + 64 * 8;
  int64_t at[PART];
  keys.offsets(at);
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t j = 0; j < G * DV; ++j) _mm256_storeu_ps(qs + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(q + 8 * j), sv));
  for (int64_t g0 = 0; g0 < G; g0 += 8) {
    const int64_t gb = std::min<int64_t>(8, G - g0);
    for (int64_t i0 = 0; i0 < n; i0 += 8) {
      const int64_t cnt = std::min<int64_t>(8, n - i0);
      for (int64_t i = 0; i < 8; ++i) {
        __m256 a[8];
        for (int g = 0; g < 8; ++g) a[g] = _mm256_setzero_ps();
        if (i < cnt) {
          const T* row = keys.k + at[i0 + i];
          if (g0 == 0) {
            if (i0 + 8 + i < n) prefetch_row(keys.k + at[i0 + 8 + i], D);
            prefetch_row(keys.v + at[i0 + i], D);
          }
          for (int c = 0; c < DV; ++c) {
            const __m256 kc = load8(row + 8 * c);
            for (int g = 0; g < 8; ++g)
              if (g < gb) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + (g0 + g) * D + 8 * c), kc, a[g]);
          }
        }
        for (int g = 0; g < gb; ++g) _mm256_storeu_ps(dots + (g * 8 + i) * 8, a[g]);
      }
      for (int64_t g = 0; g < gb; ++g) {
        __m256 v[8];
        for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(dots + (g * 8 + i) * 8);
        alignas(32) float s[8];
        _mm256_store_ps(s, sum8(v));
        std::copy(s, s + cnt, scores + (g0 + g) * PART + i0);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * PART;
    out.m[g] = *std::max_element(sg, sg + n);
    out.l[g] = exp_scores(sg, n, out.m[g]);
  }
  // Values: the rows widened once (bf16), then per head and run of 64
  // dimensions 8 accumulators against every key.
  const float* vrow[PART];
  for (int64_t i = 0; i < n; ++i) {
    const T* row = keys.v + at[i];
    if constexpr (widen_rows) {
      for (int c = 0; c < DV; ++c) _mm256_storeu_ps(values + i * D + 8 * c, load8(row + 8 * c));
      vrow[i] = values + i * D;
    } else {
      vrow[i] = row;
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int c0 = 0; c0 < DV; c0 += 8) {
      __m256 acc[8];
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
      for (int64_t i = 0; i < n; ++i) {
        const __m256 w = _mm256_set1_ps(scores[g * PART + i]);
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vrow[i] + 8 * (c0 + c)), acc[c]);
      }
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out.acc + g * D + 8 * (c0 + c), acc[c]);
    }
}
#endif

template <typename T>
void attend_part(const float* q, const Keys<T>& keys, int64_t G, int64_t D, float scale, std::vector<float>& scores,
                 const Partial& out) {
#if defined(__AVX512F__)
  scores.resize(std::max<int64_t>(G, 8) * PART);
  if (D == 64) return attend_part_avx512<T, 4, 4>(q, keys, G, scale, scores.data(), out);
  if (D == 128) return attend_part_avx512<T, 8, 2>(q, keys, G, scale, scores.data(), out);
#elif defined(__AVX2__) && defined(__FMA__)
  if (D == 64) return attend_part_avx2<T, 8>(q, keys, G, scale, scores, out);
  if (D == 128) return attend_part_avx2<T, 16>(q, keys, G, scale, scores, out);
#endif
  attend_part_generic(q, keys, G, D, scale, scores, out);
}

// ---------------------------------------------------------------------------
// Causal attention of a prompt's new tokens (a prefill, or a later chunk of
// it or a prefix-cache hit after S - T cached tokens), float32, for the
// shard's int8 path. torch's CPU flash
// attention runs these as many small GEMM calls (D = 64 keeps each tiny):
// ~4 ms a layer for 256 tokens of a 1B model's heads (32/8) on Zen 4, 6% of
// its prefill step; this kernel ~1.9 ms (1,024 tokens: 41 -> 26 ms). Its
// AVX2 form on Zen 3, one thread: 10.0 -> 6.0 ms, 1,024 tokens 111 -> 75.
//
//   out[t, hq] = sum_{u <= t + S - T} softmax_u(scale * q[t, hq] . k[u, h]) v[u, h],  h = hq / G
//
// Work items are (kv head h, tile of QT query positions), longest first; an
// item serves the G query heads of h. Each kv head's keys are copied
// transposed in chunks of 32 ([S / 32][D][32], zero past S), so a score
// tile is 8 rows x 32 keys of FMAs with one broadcast of q per row and
// dimension (AVX2, 16 registers: 6 rows x 16 keys), and its values
// contiguous ([S][D]). Each row's scores, maximum
// and sums are its own (the same whatever the tile or thread), so a
// position's result does not depend on the prompt's later tokens.
constexpr int64_t QT = 16;  // query positions per work item

namespace prefill {

// R rows of the tile, keys [0, n) (n a multiple of 32 within the padded
// keys): s[r][u] = qs[r] . k[u], from the chunked transposed keys kt; qs
// already scaled.
#if defined(__AVX512F__)
template <int R>
inline void score_rows(const float* qs, int64_t D, const float* kt, int64_t n, float* s, int64_t ls) {
  for (int64_t u0 = 0; u0 < n; u0 += 32) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float* chunk = kt + u0 * D;
    for (int64_t d = 0; d < D; ++d) {
      const __m512 k0 = _mm512_loadu_ps(chunk + 32 * d), k1 = _mm512_loadu_ps(chunk + 32 * d + 16);
      for (int r = 0; r < R; ++r) {
        const __m512 qd = _mm512_set1_ps(qs[r * D + d]);
        acc[r][0] = _mm512_fmadd_ps(qd, k0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(qd, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(s + r * ls + u0, acc[r][0]);
      _mm512_storeu_ps(s + r * ls + u0 + 16, acc[r][1]);
    }
  }
}

// o[r] = sum_u p[r][u] v[u] for R rows over keys [0, n); DV vectors per row.
template <int R, int DV>
inline void value_rows(const float* p, int64_t lp, const float* v, int64_t v_row, int64_t n, float* o, int64_t lo) {
  __m512 acc[R][DV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t u = 0; u < n; ++u) {
    __m512 vv[DV];
    for (int c = 0; c < DV; ++c) vv[c] = _mm512_loadu_ps(v + u * v_row + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * lp + u]);
      for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(o + r * lo + 16 * c, acc[r][c]);
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 has 16 vector registers, so a tile takes half a chunk (16 keys, two
// vectors) for R <= 6 rows: 2R accumulators, the two key vectors and a
// broadcast of q.
template <int R>
inline void score_rows(const float* qs, int64_t D, const float* kt, int64_t n, float* s, int64_t ls) {
  for (int64_t u0 = 0; u0 < n; u0 += 32)
    for (int64_t half = 0; half < 32; half += 16) {
      __m256 acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      const float* chunk = kt + u0 * D + half;
      for (int64_t d = 0; d < D; ++d) {
        const __m256 k0 = _mm256_loadu_ps(chunk + 32 * d), k1 = _mm256_loadu_ps(chunk + 32 * d + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 qd = _mm256_broadcast_ss(qs + r * D + d);
          acc[r][0] = _mm256_fmadd_ps(qd, k0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(qd, k1, acc[r][1]);
        }
      }
      for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(s + r * ls + u0 + half, acc[r][0]);
        _mm256_storeu_ps(s + r * ls + u0 + half + 8, acc[r][1]);
      }
    }
}

// o[r] (+)= sum_u p[r][u] v[u] for R <= 6 rows over keys [0, n), 16
// dimensions (2 vectors) at a time: 2R accumulators, the two value vectors
// loaded once for all rows, a broadcast of p; `add` adds to what o holds.
// (Four vectors for 3 rows, the values read by the FMAs themselves, took
// 15 loads for 12 FMAs: bound by the loads.)
template <int R>
inline void value_rows(const float* p, int64_t lp, const float* v, int64_t v_row, int64_t D, int64_t n, float* o,
                       int64_t lo, bool add) {
  for (int64_t c0 = 0; c0 < D; c0 += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2; ++c) acc[r][c] = add ? _mm256_loadu_ps(o + r * lo + c0 + 8 * c) : _mm256_setzero_ps();
    for (int64_t u = 0; u < n; ++u) {
      const __m256 v0 = _mm256_loadu_ps(v + u * v_row + c0), v1 = _mm256_loadu_ps(v + u * v_row + c0 + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_broadcast_ss(p + r * lp + u);
        acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2; ++c) _mm256_storeu_ps(o + r * lo + c0 + 8 * c, acc[r][c]);
  }
}

// exp_nonpositive, 8 lanes at a time.
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum8(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
#endif

// The portable forms (any D), for builds without AVX-512 or AVX2 (and AVX2
// values of a D not a multiple of 16).
inline void score_rows_generic(int R, const float* qs, int64_t D, const float* kt, int64_t n, float* s, int64_t ls) {
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * ls;
    std::fill(sr, sr + n, 0.f);
    for (int64_t u0 = 0; u0 < n; u0 += 32)
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qs[r * D + d];
        const float* kd = kt + u0 * D + 32 * d;
#pragma omp simd
        for (int64_t j = 0; j < 32; ++j) sr[u0 + j] += qd * kd[j];
      }
  }
}

inline void value_rows_generic(int R, int64_t D, const float* p, int64_t lp, const float* v, int64_t v_row, int64_t n,
                               float* o, int64_t lo) {
  for (int r = 0; r < R; ++r) {
    float* orow = o + r * lo;
    std::fill(orow, orow + D, 0.f);
    for (int64_t u = 0; u < n; ++u) {
      const float w = p[r * lp + u];
      const float* vu = v + u * v_row;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) orow[i] += w * vu[i];
    }
  }
}

// s[0, n) = e^(s - max), zero on [n, end); returns 1 / their sum.
inline float softmax_row(float* s, int64_t n, int64_t end) {
#if defined(__AVX512F__)
  auto mask = [&](int64_t u) { return static_cast<__mmask16>(n - u >= 16 ? 0xFFFF : (1u << (n - u)) - 1); };
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t u = 0; u < n; u += 16) mv = _mm512_mask_max_ps(mv, mask(u), mv, _mm512_maskz_loadu_ps(mask(u), s + u));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t u = 0; u < n; u += 16) {
    const __m512 e = _mm512_maskz_mov_ps(mask(u), exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + u), m)));
    _mm512_storeu_ps(s + u, e);  // lanes past n become 0 (s has room to a multiple of 32)
    sum = _mm512_add_ps(sum, e);
  }
  std::fill(s + (n + 15) / 16 * 16, s + std::max(end, (n + 15) / 16 * 16), 0.f);
  return 1.f / _mm512_reduce_add_ps(sum);
#elif defined(__AVX2__) && defined(__FMA__)
  const int64_t n8 = n / 8 * 8;
  __m256 mv = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t u = 0; u < n8; u += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + u));
  float m = hmax8(mv);
  for (int64_t u = n8; u < n; ++u) m = std::max(m, s[u]);
  const __m256 m8 = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t u = 0; u < n8; u += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + u), m8));
    _mm256_storeu_ps(s + u, e);
    sum = _mm256_add_ps(sum, e);
  }
  float l = hsum8(sum);
  for (int64_t u = n8; u < n; ++u) l += s[u] = exp_nonpositive(s[u] - m);
  std::fill(s + n, s + end, 0.f);
  return 1.f / l;
#else
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t u = 0; u < n; ++u) m = std::max(m, s[u]);
  const float l = exp_scores(s, n, m);
  std::fill(s + n, s + end, 0.f);
  return 1.f / l;
#endif
}

// fn(first row, rows) over `rows` rows in groups of `tile`.
template <typename Fn>
inline void in_groups(int64_t rows, int64_t tile, const Fn& fn) {
  for (int64_t r0 = 0; r0 < rows; r0 += tile) fn(r0, std::min(tile, rows - r0));
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// fn(first row, std::integral_constant<int, rows>) over `rows` rows in
// groups of 6 (the AVX2 tiles' most), then the largest of 4, 2, 1 that fits.
template <typename Fn>
inline void in_avx2_groups(int64_t rows, const Fn& fn) {
  for (int64_t r = 0; r < rows;) {
    const int64_t left = rows - r;
    if (left >= 6) fn(r, std::integral_constant<int, 6>{}), r += 6;
    else if (left >= 4) fn(r, std::integral_constant<int, 4>{}), r += 4;
    else if (left >= 2) fn(r, std::integral_constant<int, 2>{}), r += 2;
    else fn(r, std::integral_constant<int, 1>{}), r += 1;
  }
}
#endif

void scores(const float* qs, int64_t R, int64_t D, const float* kt, int64_t n, float* s, int64_t ls) {
#if defined(__AVX512F__)
  in_groups(R, 8, [&](int64_t r0, int64_t m) {
    const float* q = qs + r0 * D;
    float* sr = s + r0 * ls;
    switch (m) {
      case 8: return score_rows<8>(q, D, kt, n, sr, ls);
      case 4: return score_rows<4>(q, D, kt, n, sr, ls);
      default:
        for (int64_t r = 0; r < m; ++r) score_rows<1>(q + r * D, D, kt, n, sr + r * ls, ls);
    }
  });
#elif defined(__AVX2__) && defined(__FMA__)
  // Chunk by chunk, every row of the tile, so a chunk's keys are read from
  // L2 once and then from L1 (all rows against all keys, group by group,
  // read them once per 6 rows: L2 bound, 2x slower at 1,024 keys).
  for (int64_t u0 = 0; u0 < n; u0 += 32)
    in_avx2_groups(R, [&](int64_t r, auto rows) {
      score_rows<decltype(rows)::value>(qs + r * D, D, kt + u0 * D, 32, s + r * ls + u0, ls);
    });
#else
  score_rows_generic(static_cast<int>(R), qs, D, kt, n, s, ls);
#endif
}

void values(const float* p, int64_t R, int64_t lp, const float* v, int64_t v_row, int64_t D, int64_t n, float* o,
            int64_t lo) {
#if defined(__AVX512F__)
  if (D == 64)
    return in_groups(R, 4, [&](int64_t r0, int64_t m) {
      if (m == 4) return value_rows<4, 4>(p + r0 * lp, lp, v, v_row, n, o + r0 * lo, lo);
      for (int64_t r = r0; r < r0 + m; ++r) value_rows<1, 4>(p + r * lp, lp, v, v_row, n, o + r * lo, lo);
    });
  if (D == 128)
    return in_groups(R, 2, [&](int64_t r0, int64_t m) {
      if (m == 2) value_rows<2, 8>(p + r0 * lp, lp, v, v_row, n, o + r0 * lo, lo);
      else value_rows<1, 8>(p + r0 * lp, lp, v, v_row, n, o + r0 * lo, lo);
    });
#elif defined(__AVX2__) && defined(__FMA__)
  // Keys in runs of VB, each run's values (VB rows) read from L2 once for
  // all rows of the tile, as the scores' chunks are.
  constexpr int64_t VB = 64;
  if (D % 16 == 0) {
    for (int64_t u0 = 0; u0 < n; u0 += VB) {
      const int64_t len = std::min(VB, n - u0);
      in_avx2_groups(R, [&](int64_t r, auto rows) {
        value_rows<decltype(rows)::value>(p + r * lp + u0, lp, v + u0 * v_row, v_row, D, len, o + r * lo, lo, u0 > 0);
      });
    }
    return;
  }
#endif
  value_rows_generic(static_cast<int>(R), D, p, lp, v, v_row, n, o, lo);
}

}  // namespace prefill

}  // namespace

namespace sluice_cpu {

void paged_decode_attention(
    at::Tensor out,           // [B, Hq, D] (rows may be strided)
    const at::Tensor& q,      // [B, Hq, D] (rows may be strided)
    const at::Tensor& k_cache,  // [NB, BS, Hkv, D]
    const at::Tensor& v_cache,  // [NB, BS, Hkv, D]
    const at::Tensor& block_tables,  // [B, >= max blocks] int64
    const at::Tensor& seq_lens,      // [B] int64
    double scale,
    int64_t window,                  // 0: the whole context; W > 0: the last W keys
    const std::optional<at::Tensor>& sinks) {  // [Hq] float32: each head's sink logit
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3, "q and out must be [B, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "caches must be [NB, BS, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "q and out must be float32");
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || k_cache.scalar_type() == at::kFloat) && v_cache.scalar_type() == k_cache.scalar_type(),
              "the caches must both be float32 or both bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim differs between q and the cache");
  TORCH_CHECK(Hq % Hkv == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && out.stride(2) == 1 && out.stride(1) == D,
              "q and out must have contiguous heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && block_tables.stride(1) == 1,
              "block_tables must be [B, max_blocks] with contiguous rows");
  TORCH_CHECK(seq_lens.numel() == B && seq_lens.is_contiguous(), "seq_lens must be [B]");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                     sinks->numel() == Hq),
              "sinks must be contiguous float32 [Hq]");
  const float* sink = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  const int64_t G = Hq / Hkv;
  const int64_t max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t q_row = q.stride(0), o_row = out.stride(0), t_row = block_tables.stride(0);
  const int64_t token_stride = Hkv * D, block_stride = BS * Hkv * D;
  std::vector<int64_t> first(B), parts(B), first_item(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] > 0 && lens[b] <= max_blocks * BS, "seq_len out of the block table's range");
    first[b] = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    for (int64_t j = first[b] / BS; j < (lens[b] + BS - 1) / BS; ++j) {
      const int64_t blk = tables[b * t_row + j];
      TORCH_CHECK(blk >= 0 && blk < NB, "block id out of range");
    }
    parts[b] = (lens[b] - first[b] + PART - 1) / PART;
    first_item[b + 1] = first_item[b] + Hkv * parts[b];
  }
  const int64_t items = first_item[B];
  std::vector<float> part_m(items * G), part_l(items * G), part_acc(items * G * D);
  const float sc = static_cast<float>(scale);
  // The items, over caches of element type T (float or at::BFloat16).
  auto attend_items = [&](const auto* kp, const auto* vp) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(kp)>>;
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = std::upper_bound(first_item.begin(), first_item.end(), i) - first_item.begin() - 1;
        const int64_t local = i - first_item[b], h = local / parts[b], p = local % parts[b];
        const int64_t t0 = first[b] + p * PART, t1 = std::min(lens[b], t0 + PART);
        const Keys<T> keys{kp + h * D, vp + h * D, tables + b * t_row, t0, t1, BS, token_stride, block_stride};
        const Partial part{part_m.data() + i * G, part_l.data() + i * G, part_acc.data() + i * G * D};
        attend_part(qp + b * q_row + h * G * D, keys, G, D, sc, scores, part);
      }
    });
  };
  if (bf16)
    attend_items(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  else
    attend_items(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv;
      const int64_t item0 = first_item[b] + h * parts[b];
      for (int64_t g = 0; g < G; ++g) {
        float m = sink ? sink[h * G + g] : -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < parts[b]; ++p) m = std::max(m, part_m[(item0 + p) * G + g]);
        float l = sink ? exp_nonpositive(sink[h * G + g] - m) : 0.f;
        float* o = op + b * o_row + (h * G + g) * D;
        std::fill(o, o + D, 0.f);
        for (int64_t p = 0; p < parts[b]; ++p) {
          const int64_t k = (item0 + p) * G + g;
          const float w = exp_nonpositive(part_m[k] - m);
          l += w * part_l[k];
          const float* a = part_acc.data() + k * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = 1.f / l;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  });
}

}  // namespace sluice_cpu

namespace sluice_cpu {

void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v and out must be [tokens, heads, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat,
              "q, k, v and out must be float32");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), S = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  TORCH_CHECK(k.sizes() == v.sizes() && S >= T && k.size(2) == D,
              "k and v must be [S, Hkv, D] with S >= q's tokens and q's D");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && out.stride(2) == 1 && out.stride(1) == D,
              "q and out must have contiguous heads (rows may be strided)");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k and v rows must be contiguous");
  if (T == 0) return;
  const int64_t G = Hq / Hkv, Tp = (S + 31) / 32 * 32, offset = S - T;
  const float sc = static_cast<float>(scale);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t q_row = q.stride(0), k_row = k.stride(0), v_row = v.stride(0), o_row = out.stride(0);
  const int64_t k_head = k.stride(1), v_head = v.stride(1);
  // Per kv head: the keys transposed in chunks of 32, [Tp / 32][D][32]
  // (zero past T), and the values' rows [T][D], each contiguous.
  std::vector<float> kt(Hkv * Tp * D, 0.f), vh(Hkv * S * D);
  at::parallel_for(0, Hkv, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t h = lo; h < hi; ++h)
      for (int64_t u = 0; u < S; ++u) {
        float* chunk = kt.data() + (h * Tp + u / 32 * 32) * D + u % 32;
        for (int64_t d = 0; d < D; ++d) chunk[32 * d] = kp[u * k_row + h * k_head + d];
        std::memcpy(vh.data() + (h * S + u) * D, vp + u * v_row + h * v_head, D * sizeof(float));
      }
  });
  const int64_t tiles = (T + QT - 1) / QT, items = Hkv * tiles;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // Score rows 16 floats longer than the keys: rows a multiple of 4 KiB
    // apart would share their L1 sets.
    const int64_t ls = Tp + 16;
    std::vector<float> qs(QT * D), s(QT * ls), o(QT * D);
    float inv[QT];
    for (;;) {
      // The tiles with the most keys first, so the threads end together.
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= items) break;
      const int64_t tile = tiles - 1 - i / Hkv, h = i % Hkv;
      const int64_t t0 = tile * QT, R = std::min(QT, T - t0), n = offset + t0 + R, np = (n + 31) / 32 * 32;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t hq = h * G + g;
        for (int64_t r = 0; r < R; ++r)
          for (int64_t d = 0; d < D; ++d) qs[r * D + d] = qp[(t0 + r) * q_row + hq * D + d] * sc;
        prefill::scores(qs.data(), R, D, kt.data() + h * Tp * D, np, s.data(), ls);
        for (int64_t r = 0; r < R; ++r)  // row r sees keys [0, offset + t0 + r]
          inv[r] = prefill::softmax_row(s.data() + r * ls, offset + t0 + r + 1, n);
        prefill::values(s.data(), R, ls, vh.data() + h * S * D, D, D, n, o.data(), D);
        for (int64_t r = 0; r < R; ++r) {
          float* dst = op + (t0 + r) * o_row + hq * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) dst[d] = o[r * D + d] * inv[r];
        }
      }
    }
  });
}

}  // namespace sluice_cpu

TORCH_LIBRARY_FRAGMENT(sluice_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window=0, Tensor? sinks=None) -> ()");
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(sluice_cpu, CPU, m) {
  m.impl("paged_decode_attention", &sluice_cpu::paged_decode_attention);
  m.impl("prefill_attention", &sluice_cpu::prefill_attention);
}
