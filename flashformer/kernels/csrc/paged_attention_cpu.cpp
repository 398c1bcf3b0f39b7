// Attention of a batch of sequences over cached keys, on the CPU, in one call: the operators
// flashformer::paged_attention_cpu (paged_attention's backend "cpu", a paged KV cache) and
// flashformer::attention_cpu (attention()'s backend "cpu", a static cache's view), which
// attention/cpu_kernel.py runs, and the native decoder's attention step. Their schemas live in
// kernels/operators.py, their ATen side in operators_cpu.cpp (the tasks of a call), the argument
// checks and docs in attention/cpu_kernel.py.
//
//   q (T, Hq, D) float32: the queries of S sequences packed one after another, sequence s's
//   rows q_starts[s] .. q_starts[s + 1] - 1 (q_starts (S + 1,) int64); k_pool (Hk, num_blocks,
//   block_size, D), v_pool (..., Dv) float32, float16 or (Dv = D, a multiple of 32) uint8 rows of
//   q8_0 / q4_0 blocks, each its own type (kv_blocks.h: widened exactly to float32 as they are
//   read), any strides but a contiguous last dim;
//   block_tables (S, max_blocks) int32/int64; seq_lens (S,) int32/int64. Query i of the n of
//   sequence s sits at key position seq_lens[s] - n + i; causal: it sees the keys at or before
//   it (bottom-right). window_left / window_right: keys kept before / after it (-1: unbounded);
//   key_padding (S, >= seq_len) bool: False drops sequence s's key at that position; softcap > 0:
//   scores become softcap * tanh(scores / softcap); alibi_slopes (S|1, Hq) adds
//   -slope * |query position - key position|. Returns out (T, Hq, Dv) and lse (T, Hq); a query
//   with no key gets 0 and -inf.
//   A batch of B rows of Lq queries each is the case q_starts = 0, Lq, 2 Lq, ...; a static cache
//   (B, Hk, L, D) is the pool k.transpose(0, 1) with one block per sequence (block_tables[b] = b,
//   block_size = L).
//
// Why this shape:
// - A decode step attends every sequence over its own keys. SDPA's CPU kernels spend most of a
//   one-query call around the arithmetic, and more per row of a batch; a server calling
//   attention() once per sequence pays a gather and a dispatch each. This is one call per layer
//   (the measurements: docs/benchmarks.md, "Decode attention on the CPU").
// - One task per (sequence, KV head): its G = Hq / Hk query heads (GQA) and Lq queries share
//   every key and value read, key by key; the blocks are read in place, never gathered.
// - Batch invariance by construction: a task's arithmetic (which keys, in which order, the
//   block-by-block online softmax) depends on its own sequence only, and one thread computes
//   it. A sequence alone and in any batch gives the same bits.

#include "attention_tasks.h"
#include "kv_blocks.h"
#include "quantized_common.h"
#include "row_ops.h"

#include <c10/util/Half.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace flashformer_cpu {
namespace {

// Eight floats in a vector register (GCC's vector extension: one AVX register in the AVX2 and
// AVX-512 builds, two SSE registers in the baseline one).
typedef float v8 __attribute__((vector_size(32)));

__attribute__((always_inline)) inline v8 load8(const float* p) {
  v8 x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}

__attribute__((always_inline)) inline void store8(float* p, v8 x) { __builtin_memcpy(p, &x, sizeof(x)); }

typedef int32_t v8i __attribute__((vector_size(32)));

// Lane i of the result: the sum of a[i]'s eight lanes (a transposing tree of pair sums, the same
// order for every lane and every call).
__attribute__((always_inline)) inline v8 lane_sums(v8 a0, v8 a1, v8 a2, v8 a3, v8 a4, v8 a5, v8 a6, v8 a7) {
  const v8 a[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
  v8 pairs[4], quads[2];
  for (int i = 0; i < 4; ++i) {
    const v8 x = a[2 * i], y = a[2 * i + 1];
    pairs[i] = __builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15);
  }
  for (int i = 0; i < 2; ++i) {
    const v8 x = pairs[2 * i], y = pairs[2 * i + 1];
    quads[i] = __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return __builtin_shufflevector(quads[0], quads[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(quads[0], quads[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// Dot products of R query rows q[r] with eight key rows k[i], n floats each: eight lanes of partial
// sums per (row, key), their lane sums, then the tail past a multiple of 8 in order. Each key's
// eight floats are loaded once for the R rows. A (row, key)'s result depends on the two rows and
// n only, never on which rows or keys share the call.
template <int R>
__attribute__((always_inline)) inline void dots8(const float* const* q, const float* const* k, int64_t n,
                                                 float scale, float* const* out) {
  // the first eight columns' products start the sums (no zeroed array: GCC would clear it in
  // memory with a string store, a cost per call)
  v8 acc[R][8];
  int64_t j = 0;
  if (n >= 8) {
    v8 x[R];
    for (int r = 0; r < R; ++r) x[r] = load8(q[r]);
    for (int i = 0; i < 8; ++i) {
      const v8 key = load8(k[i]);
      for (int r = 0; r < R; ++r) acc[r][i] = x[r] * key;
    }
    j = 8;
  } else {
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < 8; ++i) acc[r][i] = v8{};
    }
  }
  for (; j + 8 <= n; j += 8) {
    v8 x[R];
    for (int r = 0; r < R; ++r) x[r] = load8(q[r] + j);
#pragma GCC unroll 8  // (rows::fmadd's eight lanes make GCC keep these loops, and acc in memory)
    for (int i = 0; i < 8; ++i) {
      const v8 key = load8(k[i] + j);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][i] = rows::fmadd(x[r], key, acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    v8 sums = lane_sums(acc[r][0], acc[r][1], acc[r][2], acc[r][3], acc[r][4], acc[r][5], acc[r][6], acc[r][7]);
    for (int i = 0; i < 8; ++i) {
      for (int64_t t = j; t < n; ++t) sums[i] = std::fma(q[r][t], k[i][t], sums[i]);
    }
    store8(out[r], sums * scale);
  }
}

// acc[r] = rescale[r] * acc[r] + sum over keys t of w[r][t] * v[t], for R rows and 64 columns
// (d0 .. d0 + 63) in registers; each value row's eight floats are loaded once for the R rows.
// A key whose weight is 0 for every row is skipped (a masked key adds nothing).
template <int R>
__attribute__((always_inline)) inline void weighted_values64(float* const* acc, const float* rescale,
                                                             const float* const* w, const float* const* v,
                                                             int64_t keys, int64_t d0) {
  v8 a[R][8];
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < 8; ++i) a[r][i] = load8(acc[r] + d0 + 8 * i) * rescale[r];
  }
  for (int64_t t = 0; t < keys; ++t) {
    float wt[R];
    bool any = false;
    for (int r = 0; r < R; ++r) wt[r] = w[r][t], any |= wt[r] != 0.f;
    if (!any) continue;
    const float* vt = v[t] + d0;
#pragma GCC unroll 8  // (as in dots8)
    for (int i = 0; i < 8; ++i) {
      const v8 value = load8(vt + 8 * i);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) a[r][i] = rows::fmadd(rows::splat(wt[r]), value, a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < 8; ++i) store8(acc[r] + d0 + 8 * i, a[r][i]);
  }
}

// Query rows per pass of dots8 and weighted_values64: 3 rows x 8 accumulators fit the 32 vector
// registers of AVX-512 (SmolLM2's 3 query heads per KV head share every load).
constexpr int64_t kRowsPerPass = 3;

// exp(x) for x <= 0 (softmax weights), 0 where x is -inf: n = round(x / ln 2) half down, then
// row_ops.h's 2^n e^r. x below -87 is taken as -87 (a weight < 2e-38).
__attribute__((always_inline)) inline v8 exp8(v8 x) {
  const auto masked = x == -__builtin_inff();
  x = x < -87.f ? v8{} - 87.f : x;
  const v8i n = __builtin_convertvector(x * 1.44269504f - 0.5f, v8i);  // round half down (x <= 0)
  return masked ? v8{} : rows::exp_near(x, __builtin_convertvector(n, v8));
}

#if defined(__x86_64__)
// kv_widen_rows for float16 (F16C's exact conversion) and the block types (their integers widened
// exactly, then one multiply by the block's scale: the scalar loop's bits) on AVX2.
__attribute__((target("avx2,f16c"))) void widen_rows_avx2(int type, const void* base, const int64_t* at,
                                                          int64_t rows, int64_t n, float* dst) {
  for (int64_t i = 0; i < rows; ++i) {
    float* out = dst + i * n;
    if (type == kKvFloat16) {
      const uint16_t* row = static_cast<const uint16_t*>(base) + at[i];
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) {
        _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j))));
      }
      for (; j < n; ++j) out[j] = c10::detail::fp16_ieee_to_fp32_value(row[j]);
      continue;
    }
    const uint8_t* block = static_cast<const uint8_t*>(base) + at[i];
    const int64_t block_bytes = kv_row_bytes(type, kKvBlock);
    for (int64_t j = 0; j < n; j += kKvBlock, block += block_bytes) {
      uint16_t bits;
      std::memcpy(&bits, block, 2);
      const __m256 d = _mm256_set1_ps(c10::detail::fp16_ieee_to_fp32_value(bits));
      if (type == kKvQ8_0) {
        for (int g = 0; g < 4; ++g) {
          const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * g));
          _mm256_storeu_ps(out + j + 8 * g, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
        }
      } else {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
        const __m128i mask = _mm_set1_epi8(0x0F);
        const __m128i halves[2] = {_mm_and_si128(packed, mask), _mm_and_si128(_mm_srli_epi16(packed, 4), mask)};
        const __m256i eight = _mm256_set1_epi32(8);
        for (int g = 0; g < 4; ++g) {  // elements 0-7, 8-15 (low nibbles), 16-23, 24-31 (high)
          const __m128i bytes = g % 2 == 0 ? halves[g / 2] : _mm_srli_si128(halves[g / 2], 8);
          const __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), eight);
          _mm256_storeu_ps(out + j + 8 * g, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
        }
      }
    }
  }
}
#endif

}  // namespace

void kv_widen_rows(int type, const void* base, const int64_t* at, int64_t rows, int64_t n, float* dst) {
#if defined(__x86_64__)
  if (use_isa().load(std::memory_order_relaxed) >= kAvx2) {  // the ISA switch
    note_ran(kWideningKv, kAvx2);
    return widen_rows_avx2(type, base, at, rows, n, dst);
  }
#endif
  note_ran(kWideningKv, kScalar);
  for (int64_t i = 0; i < rows; ++i) {
    float* out = dst + i * n;
    if (type == kKvFloat16) {
      const uint16_t* row = static_cast<const uint16_t*>(base) + at[i];
      for (int64_t j = 0; j < n; ++j) out[j] = c10::detail::fp16_ieee_to_fp32_value(row[j]);
      continue;
    }
    const uint8_t* block = static_cast<const uint8_t*>(base) + at[i];
    for (int64_t j = 0; j < n; j += kKvBlock, block += kv_row_bytes(type, kKvBlock)) {
      uint16_t bits;
      std::memcpy(&bits, block, 2);
      const float d = c10::detail::fp16_ieee_to_fp32_value(bits);
      for (int64_t e = 0; e < kKvBlock; ++e) {
        const int q = type == kKvQ8_0 ? static_cast<int8_t>(block[2 + e])
                                      : (e < kKvBlock / 2 ? block[2 + e] & 0x0F : block[2 + e - kKvBlock / 2] >> 4) - 8;
        out[j + e] = static_cast<float>(q) * d;
      }
    }
  }
}

namespace {

// Queries of one sequence per task (see attend): 16 x SmolLM2's 3 query heads a KV head = 48 rows.
constexpr int64_t kQuerySlice = 16;
// Keys per step of the online softmax: consecutive positions whatever blocks hold them (a paged
// cache's 16-key blocks would pay a row's max, rescale and sums every 16 keys).
constexpr int64_t kSpan = 64;

// Where one span of a task's keys (positions key0 .. key0 + keys - 1) is read from, as float32 rows.
struct Span {
  const float* key_rows[kSpan];
  const float* value_rows[kSpan];
  int64_t k_at[kSpan], v_at[kSpan];            // their offsets in the cache
  int64_t next_k_at[kSpan], next_v_at[kSpan];  // a float16 cache: the next span's, fetched meanwhile
};

// The element offsets of KV head h's keys (k_at) and values (v_at) at positions key0 .. key0 +
// keys - 1, wherever the table's blocks put them (one division, then a step per key).
__attribute__((always_inline)) inline void span_offsets(const Problem& p, const int64_t* table, int64_t h, int64_t key0,
                                                        int64_t keys, int64_t* k_at, int64_t* v_at) {
  if (keys <= 0) return;  // (the table may end here)
  int64_t j = key0 / p.block_size, offset = key0 % p.block_size;
  int64_t k = h * p.k_head_stride + table[j] * p.k_block_stride + offset * p.k_pos_stride;
  int64_t v = h * p.v_head_stride + table[j] * p.v_block_stride + offset * p.v_pos_stride;
  for (int64_t t = 0; t < keys; ++t, ++offset, k += p.k_pos_stride, v += p.v_pos_stride) {
    if (offset == p.block_size) {  // the next block of the table
      ++j, offset = 0;
      k = h * p.k_head_stride + table[j] * p.k_block_stride;
      v = h * p.v_head_stride + table[j] * p.v_block_stride;
    }
    k_at[t] = k, v_at[t] = v;
  }
}

// Step 1, per span: find its keys and values in the cache; a cache of another type than float32
// (float16, q8_0, q4_0) has them widened once, for every query row of the task, and the next
// span's offsets found for prefetching. Returns how many rows of the next span there are to
// prefetch (0 for a float32 cache).
__attribute__((always_inline)) inline int64_t load_span(const Problem& p, const Task& task, const int64_t* table,
                                                        int64_t key0, int64_t keys, Scratch& scratch, Span& span) {
  span_offsets(p, table, task.h, key0, keys, span.k_at, span.v_at);
  const bool wide_k = p.k_type != kKvFloat32, wide_v = p.v_type != kKvFloat32;
  if (wide_k) kv_widen_rows(p.k_type, p.k, span.k_at, keys, p.dim, scratch.wide_k.data());
  if (wide_v) kv_widen_rows(p.v_type, p.v, span.v_at, keys, p.dim_v, scratch.wide_v.data());
  for (int64_t t = 0; t < keys; ++t) {
    span.key_rows[t] = wide_k ? scratch.wide_k.data() + t * p.dim : static_cast<const float*>(p.k) + span.k_at[t];
    span.value_rows[t] =
        wide_v ? scratch.wide_v.data() + t * p.dim_v : static_cast<const float*>(p.v) + span.v_at[t];
  }
  if (!wide_k && !wide_v) return 0;
  const int64_t ahead = std::min(kSpan, std::max<int64_t>(0, task.visible - key0 - kSpan));
  span_offsets(p, table, task.h, key0 + kSpan, ahead, span.next_k_at, span.next_v_at);
  return ahead;
}

// Fetch the rows of a widened type for the next span (a line of 64 bytes at a time).
__attribute__((always_inline)) inline void prefetch_rows(const void* pool, int type, const int64_t* at, int64_t t0,
                                                         int64_t t1, int64_t dim) {
  const char* base = static_cast<const char*>(pool);
  const int64_t bytes = kv_row_bytes(type, dim), size = kv_element_bytes(type);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(base + at[t] * size + c, 0, 2);
  }
}

// While keys t0 .. t0 + 7 are scored: a widened span's rows are in working memory already, so
// fetch the next span's; a float32 cache streams from memory, so fetch these keys' values and
// the keys 16 ahead.
__attribute__((always_inline)) inline void prefetch_for_scores(const Problem& p, const Span& span, int64_t keys,
                                                               int64_t ahead, int64_t t0) {
  const int64_t t1 = std::min(t0 + 8, keys);
  if (p.k_type != kKvFloat32) {
    prefetch_rows(p.k, p.k_type, span.next_k_at, t0, std::min(t0 + 8, ahead), p.dim);
  } else {
    for (int64_t t = t0; t + 16 < keys && t < t1; ++t) {
      for (int64_t c = 0; c < p.dim; c += 16) __builtin_prefetch(span.key_rows[t + 16] + c, 0, 3);
    }
  }
  if (p.v_type != kKvFloat32) {
    prefetch_rows(p.v, p.v_type, span.next_v_at, t0, std::min(t0 + 8, ahead), p.dim_v);
  } else {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t c = 0; c < p.dim_v; c += 16) __builtin_prefetch(span.value_rows[t] + c, 0, 2);
    }
  }
}

// Step 2: each row's scaled scores of the span's keys (row r at s + r * kSpan), eight keys at a
// time (a last partial eight repeats its last key), every query row using the eight while they
// are in L1.
__attribute__((always_inline)) inline void score_span(const Problem& p, const Task& task, int64_t rows,
                                                      const Span& span, int64_t keys, int64_t ahead, float* s) {
  const int64_t group = p.q_heads / p.kv_heads;
  for (int64_t t0 = 0; t0 < keys; t0 += 8) {
    const float* kt[8];
    for (int i = 0; i < 8; ++i) kt[i] = span.key_rows[std::min(t0 + i, keys - 1)];
    prefetch_for_scores(p, span, keys, ahead, t0);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) {
      const float* qr[kRowsPerPass];
      float* out[kRowsPerPass];
      const int64_t pass = std::min(kRowsPerPass, rows - r0);
      for (int64_t r = 0; r < pass; ++r) {  // the queries: row r0 + r's
        qr[r] = p.q + (task.q0 + (r0 + r) % task.n) * p.q_row_stride + (task.h * group + (r0 + r) / task.n) * p.dim;
        out[r] = s + (r0 + r) * kSpan + t0;
      }
      if (pass == 3) {
        dots8<3>(qr, kt, p.dim, p.scale, out);
      } else if (pass == 2) {
        dots8<2>(qr, kt, p.dim, p.scale, out);
      } else {
        dots8<1>(qr, kt, p.dim, p.scale, out);
      }
    }
  }
}

// Step 3, the rules: which keys each query sees, softcap, ALiBi (none apply to a plain decode
// step's keys, which all sit at or before its query). A key a row does not see scores -inf.
__attribute__((always_inline)) inline void apply_rules(const Problem& p, const Task& task, int64_t rows,
                                                       bool plain_rules, int64_t key0, int64_t keys, float* s) {
  const float kInf = std::numeric_limits<float>::infinity();
  const int64_t group = p.q_heads / p.kv_heads, n = task.n;
  if (plain_rules && p.causal && key0 + keys - 1 > task.first_query) {  // causal alone: each row's tail
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t seen = std::max<int64_t>(0, task.first_query + r % n - key0 + 1);
      if (seen < keys) std::fill(s + r * kSpan + seen, s + r * kSpan + keys, -kInf);
    }
  } else if (!plain_rules) {
    const bool* padding = p.key_padding ? p.key_padding + task.b * p.padding_len : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t head = task.h * group + r / n, position = task.first_query + r % n;
      const float slope = p.slopes ? p.slopes[(task.b % p.slope_rows) * p.q_heads + head] : 0.f;
      float* sr = s + r * kSpan;
      for (int64_t t = 0; t < keys; ++t) {
        const int64_t key = key0 + t;
        const bool seen = (padding == nullptr || padding[key]) && (!p.causal || key <= position) &&
                          (p.window_left < 0 || key >= position - p.window_left) &&
                          (p.window_right < 0 || key <= position + p.window_right);
        float score = -kInf;
        if (seen) {
          score = sr[t];
          if (p.softcap > 0.f) score = p.softcap * std::tanh(score / p.softcap);
          if (p.slopes) score -= slope * static_cast<float>(std::abs(position - key));
        }
        sr[t] = score;
      }
    }
  }
}

// Step 4, the online softmax: each row's weights (in place of its scores), and its running max
// m, sum l and the factor that rescales what it accumulated so far; a row with no key in this
// span keeps its state (rescale 1, weights 0).
__attribute__((always_inline)) inline void softmax_update(int64_t rows, int64_t keys, Scratch& scratch) {
  const float kInf = std::numeric_limits<float>::infinity();
  std::vector<float>&m = scratch.m, &l = scratch.l, &rescale = scratch.rescale;
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scratch.s.data() + r * kSpan;
    for (int64_t t = keys; t < (keys + 7) / 8 * 8; ++t) sr[t] = -kInf;  // the partial eight's repeats
    v8 max8 = load8(sr);
    for (int64_t t = 8; t < keys; t += 8) {
      const v8 x = load8(sr + t);
      max8 = x > max8 ? x : max8;
    }
    float block_max = max8[0];
    for (int i = 1; i < 8; ++i) block_max = std::max(block_max, max8[i]);
    if (block_max == -kInf) {
      rescale[r] = 1.f;
      std::fill(sr, sr + keys, 0.f);
      continue;
    }
    const float new_max = std::max(m[r], block_max);
    rescale[r] = std::exp(m[r] - new_max);  // 0 for the first block seen
    m[r] = new_max;
    v8 sum8 = {};
    for (int64_t t = 0; t < keys; t += 8) {
      const v8 w = exp8(load8(sr + t) - new_max);  // scores become weights
      store8(sr + t, w);
      sum8 += w;
    }
    float sum = 0.f;
    for (int i = 0; i < 8; ++i) sum += sum8[i];
    l[r] = l[r] * rescale[r] + sum;
  }
}

// Step 5: acc[r] = rescale[r] * acc[r] + weights . v, key by key, a few rows sharing each value
// row, 64 columns of the accumulator in registers (then the columns past a multiple of 64).
__attribute__((always_inline)) inline void accumulate_values(const Problem& p, int64_t rows, const Span& span,
                                                             int64_t keys, Scratch& scratch) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) {
    float* ar[kRowsPerPass];
    const float* wr[kRowsPerPass];
    const int64_t pass = std::min(kRowsPerPass, rows - r0);
    for (int64_t r = 0; r < pass; ++r) {
      ar[r] = scratch.acc.data() + (r0 + r) * p.dim_v, wr[r] = scratch.s.data() + (r0 + r) * kSpan;
    }
    const float* rs = scratch.rescale.data() + r0;
    int64_t d0 = 0;
    for (; d0 + 64 <= p.dim_v; d0 += 64) {
      if (pass == 3) {
        weighted_values64<3>(ar, rs, wr, span.value_rows, keys, d0);
      } else if (pass == 2) {
        weighted_values64<2>(ar, rs, wr, span.value_rows, keys, d0);
      } else {
        weighted_values64<1>(ar, rs, wr, span.value_rows, keys, d0);
      }
    }
    for (int64_t r = 0; r < pass && d0 < p.dim_v; ++r) {
      for (int64_t d = d0; d < p.dim_v; ++d) ar[r][d] *= rs[r];
      for (int64_t t = 0; t < keys; ++t) {
        const float w = wr[r][t];
        if (w == 0.f) continue;
        for (int64_t d = d0; d < p.dim_v; ++d) ar[r][d] = std::fma(w, span.value_rows[t][d], ar[r][d]);
      }
    }
  }
}

// Step 6: out = acc / l and lse = m + log(l) per row; a row that saw no key gets 0 and -inf.
__attribute__((always_inline)) inline void write_out(const Problem& p, const Task& task, int64_t rows,
                                                     const Scratch& scratch) {
  const float kInf = std::numeric_limits<float>::infinity();
  const int64_t group = p.q_heads / p.kv_heads;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = task.h * group + r / task.n, i = r % task.n;
    const int64_t row = (task.q0 + i) * p.q_heads + head;
    float* o = p.out + row * p.dim_v;
    if (scratch.l[r] == 0.f) {
      std::fill(o, o + p.dim_v, 0.f);
      p.lse[row] = -kInf;
      continue;
    }
    const float inverse = 1.f / scratch.l[r];
    for (int64_t d = 0; d < p.dim_v; ++d) o[d] = scratch.acc[r * p.dim_v + d] * inverse;
    p.lse[row] = scratch.m[r] + std::log(scratch.l[r]);
  }
}

// A task's G x n query rows against its keys, span by span in order, with an online softmax.
// Compiled for the baseline x86-64, AVX2 and AVX-512 (32 vector registers: kRowsPerPass), the
// same operations in the same order in each: each multiply-add of the dot products and of the
// weighted values is fused (rows::fmadd: one rounding, twice the products a cycle where the ISA
// has an FMA), everything else rounds each operation (-ffp-contract=off), so every build gives the
// same bits. attend_task runs the build use_isa() says. Every step is an always_inline function,
// so that it is compiled into each build for its target (a call to a plain function would run the
// baseline code). The task (by value) and key0, keys are the build's own values, which no call
// inside (widen_rows, expf) can change: they stay in registers, and the compiler knows keys <= kSpan.
struct AttendTask {
  __attribute__((always_inline)) static void run(const Problem& p, const Task task, const int64_t* table,
                                                 Scratch& scratch) {
    const int64_t rows = p.q_heads / p.kv_heads * task.n;
    const float kInf = std::numeric_limits<float>::infinity();
    scratch.m.assign(rows, -kInf);
    scratch.rescale.resize(rows);
    scratch.l.assign(rows, 0.f);
    scratch.acc.assign(rows * p.dim_v, 0.f);
    scratch.s.resize(rows * kSpan);
    if (p.k_type != kKvFloat32) scratch.wide_k.resize(kSpan * p.dim);
    if (p.v_type != kKvFloat32) scratch.wide_v.resize(kSpan * p.dim_v);
    const bool plain_rules = p.key_padding == nullptr && p.window_left < 0 && p.window_right < 0 && p.softcap == 0.f &&
                             p.slopes == nullptr;
    Span span;
    for (int64_t key0 = 0; key0 < task.visible; key0 += kSpan) {
      const int64_t keys = std::min(kSpan, task.visible - key0);
      if (p.window_left >= 0 && key0 + keys - 1 < task.first_query - p.window_left) continue;  // before every window
      const int64_t ahead = load_span(p, task, table, key0, keys, scratch, span);
      score_span(p, task, rows, span, keys, ahead, scratch.s.data());
      apply_rules(p, task, rows, plain_rules, key0, keys, scratch.s.data());
      softmax_update(rows, keys, scratch);
      accumulate_values(p, rows, span, keys, scratch);
    }
    write_out(p, task, rows, scratch);
  }
};

}  // namespace

void attend_task(const Problem& p, const Task task, const int64_t* table, Scratch& scratch) {
  run_built_for<AttendTask>(use_isa().load(std::memory_order_relaxed), kAttention, p, task, table, scratch);
}

std::vector<Task> attention_tasks(int64_t sequences, const int64_t* starts, const int64_t* lengths,
                                  int64_t kv_heads, bool causal) {
  // Tasks: (sequence, KV head, slice of up to kQuerySlice of its queries). A prompt chunk's
  // queries are split so that its work spreads over the threads, and under causal masking a
  // slice visits only the keys up to its last query (the keys past it are masked for all of its
  // rows, so a row's result is the same in any slice). The slices depend on the sequence alone.
  std::vector<Task> tasks;
  for (int64_t b = 0; b < sequences; ++b) {
    const int64_t n = starts[b + 1] - starts[b];
    for (int64_t i0 = 0; i0 < n; i0 += kQuerySlice) {
      const int64_t count = std::min(kQuerySlice, n - i0), first_query = lengths[b] - n + i0;
      for (int64_t h = 0; h < kv_heads; ++h) {
        tasks.push_back({b, h, first_query, causal ? first_query + count : lengths[b], starts[b] + i0, count});
      }
    }
  }
  return tasks;
}

}  // namespace flashformer_cpu
