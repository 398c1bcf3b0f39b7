// Weight-only quantized matrix products on the CPU: out = x @ W^T (+ bias), x float32 (M, K),
// W stored as 4-bit or 8-bit integers in blocks of 32 along K. Made for decoding (M = 1 to 16);
// prompts (M in the hundreds) take the same kernels, which with int8 activations outrun a float32
// GEMM on the dequantized weights (so there is no second path, and no batch-size-dependent result).
//
// The CPU implementations of the operators that flashformer/kernels/quantized.py defines
// (schemas, shape checks, fake tensors and the PyTorch fallback live there):
//
//   flashformer::int4_linear(x, qweight, scales, bias, out_features, int8_activations)
//       qweight uint8 (G, nb, 8, 16): for each group of 8 output rows and each block of 32 inputs,
//       the 8 rows' 16 bytes of GGUF Q4_1 nibbles (byte j: q[j] low, q[j + 16] high);
//       scales float16 (G, nb, 2, 8): the 8 rows' d, then their m. Weight = d * q + m.
//   flashformer::int8_linear(x, qweight, scales, bias, out_features, int8_activations)
//       qweight int8 (G, nb, 4, 32); scales float16 (G, nb, 4) per block (GGUF Q8_0: weight = d * q)
//       or float32 (G * 4,) per output row.
//   flashformer::quantized_kernel_isa(request) -> int: 1 = AVX2 kernels in use, 0 = scalar ones;
//       request 0 or 1 switches (tests compare the two), -1 only asks.
//
// Why this shape of kernel (the design of llama.cpp's ggml-cpu AVX2 path, written anew):
// - A decode step reads every weight once per token, so its time is the time to stream the
//   weights. 4-bit blocks are 0.625 bytes per weight instead of 4: the kernel must widen them in
//   registers and never write a float copy of W.
// - int8_activations: x is quantized per block of 32 to int8 once per call (scale d = amax / 127),
//   and each weight block's dot product is an exact integer sum (maddubs + madd: 32 products in
//   two instructions), then one float multiply-add with the two blocks' scales. Otherwise x stays
//   float32 and the weights are widened to float for FMAs: exact with respect to the dequantized
//   weights, more instructions per weight.
// - Output rows are interleaved (8 for int4, 4 for int8) so a group is one sequential stream and
//   one pass over an x block serves several rows.
// - Batch invariance: every (x row, output row) pair goes through the same operations in the
//   same order whatever M, the tile of x rows it falls in, or the thread that computes it; the
//   float accumulation is over blocks in order. So a row's result does not depend on its batch.
// - The scalar kernels perform the same float operations in the same order as the AVX2 ones
//   (std::fma where AVX2 has an FMA), so both give the same bits; tests check that here.
// - Threads: at::parallel_for over groups of output rows; a row is computed by one thread.
// - No backward: the Autograd kernel below gives an output that needs a gradient an Error node,
//   which raises when backward reaches it. It is C++ because a Python autograd kernel
//   (torch.library.register_autograd) costs about 5 us per call even under no_grad, as much as
//   a whole 576 x 576 product.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FF_X86 1
#define FF_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define FF_X86 0
#endif

namespace {

constexpr int64_t kBlock = 32;     // values per quantization block along K (GGUF's QK4_1, QK8_0)
constexpr int64_t kGroupRows = 4;  // int8: output rows interleaved in the packed layout; int4: half a group
// int4 groups are 8 rows (one sequential stream for the one-row kernel, which reads all 8);
// per block: 8 rows x 16 bytes of nibbles, and 8 d then 8 m as float16. The 4-row kernels take
// a half group: pointers offset by 4 rows' bytes (64) and 4 halves, the same block strides.
constexpr int64_t kInt4Rows = 8;
constexpr int64_t kInt4BlockBytes = kInt4Rows * 16;
constexpr int64_t kInt4BlockScales = 2 * kInt4Rows;
constexpr int64_t kInt8Tile = 4;   // x rows per pass over a group (their accumulators stay in registers)
constexpr int64_t kFloatTile = 2;  // the same for float activations: 4 accumulators per x row

bool cpu_has_avx2() {
#if FF_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

std::atomic<bool>& use_avx2() {
  static std::atomic<bool> flag{cpu_has_avx2()};
  return flag;
}

inline float half_to_float(uint16_t bits) {
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// x (M, K) quantized per block of 32: x[m, 32 b + j] ~ d[m, b] * q[m, b, j], q in [-127, 127].
struct Int8Rows {
  int64_t blocks = 0;
  std::vector<int8_t> q;  // (M, blocks, 32)
  std::vector<float> d;   // (M, blocks)
  std::vector<float> s;   // (M, blocks): d * sum_j q[j], what an int4 block's minimum multiplies
};

// ---- scalar kernels (any CPU; the reference order of operations) ----

void quantize_block_scalar(const float* x, int8_t* q, float* d, float* s) {
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float scale = amax / 127.f;
  const float inverse = amax != 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    const int v = static_cast<int>(std::nearbyint(x[j] * inverse));  // half to even, as AVX2's round
    q[j] = static_cast<int8_t>(v);
    sum += v;
  }
  *d = scale;
  *s = scale * static_cast<float>(sum);
}

// The 8-lane horizontal sum in the order of hsum8 below.
inline float hsum8_scalar(const float* a) {
  const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  return (s0 + s2) + (s1 + s3);
}

inline void store_rows(const float* acc, float* out, int64_t nrows, const float* bias) {
  for (int64_t r = 0; r < nrows; ++r) out[r] = bias ? acc[r] + bias[r] : acc[r];
}

// The int8-activation kernels. For an x row and an output row, block b's integer dot product is
// taken as 4 partial sums P[k] (int4: inputs 4k..4k+3 and 16+4k..16+4k+3; int8: inputs 8k..8k+7,
// the lanes AVX2 leaves them in); 4 float accumulators take acc[k] = fma(d_w * d_x, P[k], acc[k])
// over the blocks in order (d_x alone for per-row int8 scales); the row's result is
// (acc[0] + acc[1]) + (acc[2] + acc[3]), plus an int4 row's sum over blocks of m * s_x (a fifth
// accumulator), times a per-row int8 scale.
inline float sum_partials(const float* acc) {
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

void int4_int8act_scalar(int tile, const uint8_t* qw, const uint16_t* sc, int64_t nb, const Int8Rows& xa,
                         int64_t m0, float* out, int64_t ldo, int64_t nrows, const float* bias) {
  for (int t = 0; t < tile; ++t) {
    float acc[kGroupRows][4] = {};
    float acc_min[kGroupRows] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t xb = (m0 + t) * nb + b;
      const int8_t* xq = xa.q.data() + xb * kBlock;
      for (int r = 0; r < kGroupRows; ++r) {
        const uint8_t* w = qw + b * kInt4BlockBytes + r * 16;
        const float scale = half_to_float(sc[b * kInt4BlockScales + r]) * xa.d[xb];
        for (int k = 0; k < 4; ++k) {
          int partial = 0;
          for (int j = 4 * k; j < 4 * k + 4; ++j) partial += (w[j] & 15) * xq[j] + (w[j] >> 4) * xq[j + 16];
          acc[r][k] = std::fma(scale, static_cast<float>(partial), acc[r][k]);
        }
      }
    }
    for (int64_t b = 0; b < nb; ++b) {
      for (int r = 0; r < kGroupRows; ++r) {
        acc_min[r] = std::fma(half_to_float(sc[b * kInt4BlockScales + kInt4Rows + r]), xa.s[(m0 + t) * nb + b],
                              acc_min[r]);
      }
    }
    float res[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) res[r] = sum_partials(acc[r]) + acc_min[r];
    store_rows(res, out + t * ldo, nrows, bias);
  }
}

template <bool kPerBlock>
void int8_int8act_scalar(int tile, const int8_t* qw, const void* scales, int64_t nb, const Int8Rows& xa,
                         int64_t m0, float* out, int64_t ldo, int64_t nrows, const float* bias) {
  for (int t = 0; t < tile; ++t) {
    float acc[kGroupRows][4] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t xb = (m0 + t) * nb + b;
      const int8_t* xq = xa.q.data() + xb * kBlock;
      for (int r = 0; r < kGroupRows; ++r) {
        const int8_t* w = qw + (b * kGroupRows + r) * kBlock;
        const float scale = kPerBlock
            ? half_to_float(static_cast<const uint16_t*>(scales)[b * kGroupRows + r]) * xa.d[xb]
            : xa.d[xb];
        for (int k = 0; k < 4; ++k) {
          int partial = 0;
          for (int j = 8 * k; j < 8 * k + 8; ++j) partial += w[j] * xq[j];
          acc[r][k] = std::fma(scale, static_cast<float>(partial), acc[r][k]);
        }
      }
    }
    float res[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) {
      res[r] = sum_partials(acc[r]);
      if (!kPerBlock) res[r] *= static_cast<const float*>(scales)[r];
    }
    store_rows(res, out + t * ldo, nrows, bias);
  }
}

// The float-activation kernels: per block and row, 8 lanes of x[j] * w[j] chained with FMAs over
// the block's 4 slices of 8, scaled into 8 lane accumulators; an int4 row's minimums multiply the
// block's float sum of x, accumulated apart and added after the lanes' sum.
void int4_f32act_scalar(int tile, const uint8_t* qw, const uint16_t* sc, int64_t nb, const float* x,
                        int64_t ldx, const float* xsum, int64_t m0, float* out, int64_t ldo, int64_t nrows,
                        const float* bias) {
  for (int t = 0; t < tile; ++t) {
    const float* xr = x + (m0 + t) * ldx;
    float acc[kGroupRows][8] = {};
    float acc_min[kGroupRows] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t b = 0; b < nb; ++b) {
      for (int r = 0; r < kGroupRows; ++r) {
        acc_min[r] = std::fma(half_to_float(sc[b * kInt4BlockScales + kInt4Rows + r]), xsum[(m0 + t) * nb + b],
                              acc_min[r]);
      }
      for (int r = 0; r < kGroupRows; ++r) {
        const uint8_t* w = qw + b * kInt4BlockBytes + r * 16;
        float q[kBlock];
        for (int j = 0; j < 16; ++j) q[j] = static_cast<float>(w[j] & 15), q[j + 16] = static_cast<float>(w[j] >> 4);
        const float d = half_to_float(sc[b * kInt4BlockScales + r]);
        const float* xb = xr + b * kBlock;
        for (int l = 0; l < 8; ++l) {
          float p = xb[l] * q[l];
          p = std::fma(xb[8 + l], q[8 + l], p);
          p = std::fma(xb[16 + l], q[16 + l], p);
          p = std::fma(xb[24 + l], q[24 + l], p);
          acc[r][l] = std::fma(d, p, acc[r][l]);
        }
      }
    }
    float res[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) res[r] = hsum8_scalar(acc[r]) + acc_min[r];
    store_rows(res, out + t * ldo, nrows, bias);
  }
}

template <bool kPerBlock>
void int8_f32act_scalar(int tile, const int8_t* qw, const void* scales, int64_t nb, const float* x, int64_t ldx,
                        int64_t m0, float* out, int64_t ldo, int64_t nrows, const float* bias) {
  for (int t = 0; t < tile; ++t) {
    const float* xr = x + (m0 + t) * ldx;
    float acc[kGroupRows][8] = {};
    for (int64_t b = 0; b < nb; ++b) {
      for (int r = 0; r < kGroupRows; ++r) {
        const int8_t* w = qw + (b * kGroupRows + r) * kBlock;
        const float* xb = xr + b * kBlock;
        const float d = kPerBlock ? half_to_float(static_cast<const uint16_t*>(scales)[b * kGroupRows + r]) : 1.f;
        for (int l = 0; l < 8; ++l) {
          float p = xb[l] * static_cast<float>(w[l]);
          p = std::fma(xb[8 + l], static_cast<float>(w[8 + l]), p);
          p = std::fma(xb[16 + l], static_cast<float>(w[16 + l]), p);
          p = std::fma(xb[24 + l], static_cast<float>(w[24 + l]), p);
          acc[r][l] = kPerBlock ? std::fma(d, p, acc[r][l]) : acc[r][l] + p;
        }
      }
    }
    float res[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) {
      res[r] = hsum8_scalar(acc[r]);
      if (!kPerBlock) res[r] *= static_cast<const float*>(scales)[r];
    }
    store_rows(res, out + t * ldo, nrows, bias);
  }
}

// ---- AVX2 kernels (same operations, 8 or 4 lanes at a time) ----
#if FF_X86

FF_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // a0+a4 .. a3+a7
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                          // s0+s2, s1+s3
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

FF_AVX2 void quantize_block_avx2(const float* x, int8_t* q, float* d, float* s) {
  __m256 v[4];
  for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + 8 * k);
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax8 = _mm256_andnot_ps(sign, v[0]);
  for (int k = 1; k < 4; ++k) amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[k]));
  __m128 amax4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  amax4 = _mm_max_ps(amax4, _mm_movehl_ps(amax4, amax4));
  amax4 = _mm_max_ss(amax4, _mm_movehdup_ps(amax4));
  const float amax = _mm_cvtss_f32(amax4);
  const float scale = amax / 127.f;
  const __m256 inverse = _mm256_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
  __m256i i[4];
  for (int k = 0; k < 4; ++k) {
    const __m256 rounded = _mm256_round_ps(_mm256_mul_ps(v[k], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    i[k] = _mm256_cvtps_epi32(rounded);
  }
  const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
  sum4 = _mm_add_epi32(sum4, _mm_unpackhi_epi64(sum4, sum4));
  sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, 1));
  // 32 int32 -> 32 int8; the packs work per 128-bit lane, so the 4-byte pieces come out as
  // [0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, 20-23, 28-31] and one permute restores the order.
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  *d = scale;
  *s = scale * static_cast<float>(_mm_cvtsi128_si32(sum4));
}

// The sum over blocks of an int4 group's minimums times the activation blocks' sums: acc_min[t]
// for the tile's x rows, one 4-lane FMA per block (a pass of its own keeps the main loop's
// accumulators in registers).
template <int kTile>
FF_AVX2 void int4_minimums_avx2(const uint16_t* sc, int64_t nb, const Int8Rows& xa, int64_t m0, __m128* acc_min) {
  for (int t = 0; t < kTile; ++t) acc_min[t] = _mm_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m128 m4 = _mm_cvtph_ps(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + b * kInt4BlockScales + kInt4Rows)));
    for (int t = 0; t < kTile; ++t) acc_min[t] = _mm_fmadd_ps(m4, _mm_set1_ps(xa.s[(m0 + t) * nb + b]), acc_min[t]);
  }
}

// int4 weights x int8 activations. Rows (0, 1) and (2, 3) of a group sit side by side in one
// 32-byte load, so one AND (low nibbles: q[0..15]) and one shift + AND (high: q[16..31]) widen
// two rows; each half multiplies the same 16 activations, broadcast to both 128-bit lanes. The
// products' 4 partial sums per row stay in their lanes ([row 0: P0..P3 | row 1: P0..P3]) and are
// scaled by [d0 x4 | d1 x4] * d_x: no horizontal sum inside the loop.
template <int kTile>
FF_AVX2 void int4_int8act_avx2(const uint8_t* qw, const uint16_t* sc, int64_t nb, const Int8Rows& xa, int64_t m0,
                               float* out, int64_t ldo, int64_t nrows, const float* bias) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i rows01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), rows23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
  __m256 acc01[kTile], acc23[kTile];
  for (int t = 0; t < kTile; ++t) acc01[t] = acc23[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i w01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * kInt4BlockBytes));
    const __m256i w23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * kInt4BlockBytes + 32));
    const __m256i lo01 = _mm256_and_si256(w01, low4), hi01 = _mm256_and_si256(_mm256_srli_epi16(w01, 4), low4);
    const __m256i lo23 = _mm256_and_si256(w23, low4), hi23 = _mm256_and_si256(_mm256_srli_epi16(w23, 4), low4);
    const __m256 d4 = _mm256_castps128_ps256(
        _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + b * kInt4BlockScales))));  // d0..d3
    const __m256 d01 = _mm256_permutevar8x32_ps(d4, rows01), d23 = _mm256_permutevar8x32_ps(d4, rows23);
    for (int t = 0; t < kTile; ++t) {
      const int64_t xb = (m0 + t) * nb + b;
      const int8_t* xq = xa.q.data() + xb * kBlock;
      const __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq)));
      const __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 16)));
      // |pair sums| <= 2 * 15 * 127, so adding the two halves' int16 sums cannot saturate.
      const __m256i p01 = _mm256_madd_epi16(
          _mm256_add_epi16(_mm256_maddubs_epi16(lo01, xlo), _mm256_maddubs_epi16(hi01, xhi)), ones);
      const __m256i p23 = _mm256_madd_epi16(
          _mm256_add_epi16(_mm256_maddubs_epi16(lo23, xlo), _mm256_maddubs_epi16(hi23, xhi)), ones);
      const __m256 dx = _mm256_set1_ps(xa.d[xb]);
      acc01[t] = _mm256_fmadd_ps(_mm256_mul_ps(d01, dx), _mm256_cvtepi32_ps(p01), acc01[t]);
      acc23[t] = _mm256_fmadd_ps(_mm256_mul_ps(d23, dx), _mm256_cvtepi32_ps(p23), acc23[t]);
    }
  }
  __m128 acc_min[kTile];
  int4_minimums_avx2<kTile>(sc, nb, xa, m0, acc_min);
  for (int t = 0; t < kTile; ++t) {
    __m256 h = _mm256_hadd_ps(acc01[t], acc23[t]);  // [r0 r0 r2 r2 | r1 r1 r3 r3]: P0+P1, P2+P3
    h = _mm256_hadd_ps(h, h);                       // [r0 r2 r0 r2 | r1 r3 r1 r3]
    const __m128 rows = _mm_unpacklo_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    float res[kGroupRows];
    _mm_storeu_ps(res, _mm_add_ps(rows, acc_min[t]));
    store_rows(res, out + t * ldo, nrows, bias);
  }
}

// One x row against a whole group (8 output rows) with the arithmetic of int4_int8act_avx2<1>:
// the x block's loads and scale serve 8 rows instead of 4, and the group's 128 bytes per block
// are one sequential stream. Decoding one sequence is this case; with more x rows the tiles above
// share the weights' unpacking instead.
FF_AVX2 void int4_int8act_1x8_avx2(const uint8_t* qw, const uint16_t* sc, int64_t nb, const Int8Rows& xa, int64_t m,
                                   float* out, int64_t nrows, const float* bias) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i pair_rows[4];  // lanes of d8 for rows (2p, 2p + 1): [2p x4 | 2p+1 x4]
  for (int p = 0; p < 4; ++p) pair_rows[p] = _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 acc_min = _mm256_setzero_ps();  // rows 0..7
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t xb = m * nb + b;
    const int8_t* xq = xa.q.data() + xb * kBlock;
    const __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq)));
    const __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + 16)));
    const __m256 dx = _mm256_set1_ps(xa.d[xb]);
    const uint16_t* s = sc + b * kInt4BlockScales;
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
    const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + kInt4Rows)));
    for (int p = 0; p < 4; ++p) {
      const __m256i wp = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + b * kInt4BlockBytes + 32 * p));
      const __m256i lo = _mm256_and_si256(wp, low4), hi = _mm256_and_si256(_mm256_srli_epi16(wp, 4), low4);
      const __m256i sums = _mm256_madd_epi16(
          _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi)), ones);
      const __m256 d = _mm256_mul_ps(_mm256_permutevar8x32_ps(d8, pair_rows[p]), dx);
      acc[p] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sums), acc[p]);
    }
    acc_min = _mm256_fmadd_ps(m8, _mm256_set1_ps(xa.s[xb]), acc_min);
  }
  for (int h = 0; h < 2 && kGroupRows * h < nrows; ++h) {
    __m256 sums = _mm256_hadd_ps(acc[2 * h], acc[2 * h + 1]);
    sums = _mm256_hadd_ps(sums, sums);
    const __m128 rows = _mm_unpacklo_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
    const __m128 mins = h == 0 ? _mm256_castps256_ps128(acc_min) : _mm256_extractf128_ps(acc_min, 1);
    float res[kGroupRows];
    _mm_storeu_ps(res, _mm_add_ps(rows, mins));
    store_rows(res, out + kGroupRows * h, std::min(kGroupRows, nrows - kGroupRows * h),
               bias ? bias + kGroupRows * h : nullptr);
  }
}

// int8 weights x int8 activations: maddubs multiplies unsigned by signed bytes, so the weight's
// sign moves onto the activation (|w| * sign(w) x). Activations are never -128, so negating them
// cannot overflow; |w| = 128 (a -128 in a file) still fits as unsigned, and pair sums stay
// <= 2 * 128 * 127 < 32767. One hadd puts two rows' 4 partial sums (inputs 8k..8k+7) in one
// vector: [r0 P0 P1, r1 P0 P1 | r0 P2 P3, r1 P2 P3].
template <int kTile, bool kPerBlock>
FF_AVX2 void int8_int8act_avx2(const int8_t* qw, const void* scales, int64_t nb, const Int8Rows& xa, int64_t m0,
                               float* out, int64_t ldo, int64_t nrows, const float* bias) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i rows01 = _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1), rows23 = _mm256_setr_epi32(2, 2, 3, 3, 2, 2, 3, 3);
  __m256 acc01[kTile], acc23[kTile];
  for (int t = 0; t < kTile; ++t) acc01[t] = acc23[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i w[kGroupRows], w_abs[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) {
      w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + (b * kGroupRows + r) * kBlock));
      w_abs[r] = _mm256_sign_epi8(w[r], w[r]);
    }
    __m256 d01 = _mm256_set1_ps(1.f), d23 = d01;
    if (kPerBlock) {
      const __m256 d4 = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(scales) + b * kGroupRows))));
      d01 = _mm256_permutevar8x32_ps(d4, rows01);
      d23 = _mm256_permutevar8x32_ps(d4, rows23);
    }
    for (int t = 0; t < kTile; ++t) {
      const int64_t xb = (m0 + t) * nb + b;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa.q.data() + xb * kBlock));
      __m256i p[kGroupRows];
      for (int r = 0; r < kGroupRows; ++r) {
        p[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs[r], _mm256_sign_epi8(xq, w[r])), ones);
      }
      const __m256 dx = _mm256_set1_ps(xa.d[xb]);
      const __m256 s01 = kPerBlock ? _mm256_mul_ps(d01, dx) : dx, s23 = kPerBlock ? _mm256_mul_ps(d23, dx) : dx;
      acc01[t] = _mm256_fmadd_ps(s01, _mm256_cvtepi32_ps(_mm256_hadd_epi32(p[0], p[1])), acc01[t]);
      acc23[t] = _mm256_fmadd_ps(s23, _mm256_cvtepi32_ps(_mm256_hadd_epi32(p[2], p[3])), acc23[t]);
    }
  }
  for (int t = 0; t < kTile; ++t) {
    const __m256 h = _mm256_hadd_ps(acc01[t], acc23[t]);  // [P0+P1 of r0..r3 | P2+P3 of r0..r3]
    __m128 rows = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    if (!kPerBlock) rows = _mm_mul_ps(rows, _mm_loadu_ps(static_cast<const float*>(scales)));
    float res[kGroupRows];
    _mm_storeu_ps(res, rows);
    store_rows(res, out + t * ldo, nrows, bias);
  }
}

FF_AVX2 inline __m256 dot_block8(const float* x, __m256 w0, __m256 w1, __m256 w2, __m256 w3) {
  __m256 p = _mm256_mul_ps(_mm256_loadu_ps(x), w0);
  p = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), w1, p);
  p = _mm256_fmadd_ps(_mm256_loadu_ps(x + 16), w2, p);
  return _mm256_fmadd_ps(_mm256_loadu_ps(x + 24), w3, p);
}

template <int kTile>
FF_AVX2 void int4_f32act_avx2(const uint8_t* qw, const uint16_t* sc, int64_t nb, const float* x, int64_t ldx,
                              const float* xsum, int64_t m0, float* out, int64_t ldo, int64_t nrows,
                              const float* bias) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[kTile][kGroupRows];
  __m128 acc_min[kTile];
  for (int t = 0; t < kTile; ++t) {
    acc_min[t] = _mm_setzero_ps();
    for (int r = 0; r < kGroupRows; ++r) acc[t][r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    alignas(16) float d[kGroupRows];
    _mm_store_ps(d, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + b * kInt4BlockScales))));
    const __m128 m4 = _mm_cvtph_ps(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + b * kInt4BlockScales + kInt4Rows)));
    for (int t = 0; t < kTile; ++t) acc_min[t] = _mm_fmadd_ps(m4, _mm_set1_ps(xsum[(m0 + t) * nb + b]), acc_min[t]);
    for (int r = 0; r < kGroupRows; ++r) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qw + b * kInt4BlockBytes + r * 16));
      const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
      const __m256 dr = _mm256_set1_ps(d[r]);
      for (int t = 0; t < kTile; ++t) {
        const __m256 p = dot_block8(x + (m0 + t) * ldx + b * kBlock, w0, w1, w2, w3);
        acc[t][r] = _mm256_fmadd_ps(dr, p, acc[t][r]);
      }
    }
  }
  for (int t = 0; t < kTile; ++t) {
    float mins[kGroupRows], res[kGroupRows];
    _mm_storeu_ps(mins, acc_min[t]);
    for (int r = 0; r < kGroupRows; ++r) res[r] = hsum8(acc[t][r]) + mins[r];
    store_rows(res, out + t * ldo, nrows, bias);
  }
}

template <int kTile, bool kPerBlock>
FF_AVX2 void int8_f32act_avx2(const int8_t* qw, const void* scales, int64_t nb, const float* x, int64_t ldx,
                              int64_t m0, float* out, int64_t ldo, int64_t nrows, const float* bias) {
  __m256 acc[kTile][kGroupRows];
  for (int t = 0; t < kTile; ++t) {
    for (int r = 0; r < kGroupRows; ++r) acc[t][r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    alignas(16) float d[kGroupRows] = {1.f, 1.f, 1.f, 1.f};
    if (kPerBlock) {
      _mm_store_ps(d, _mm_cvtph_ps(_mm_loadl_epi64(
                          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(scales) + b * kGroupRows))));
    }
    for (int r = 0; r < kGroupRows; ++r) {
      const int8_t* wp = qw + (b * kGroupRows + r) * kBlock;
      const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp));
      const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
      const __m256 dr = _mm256_set1_ps(d[r]);
      for (int t = 0; t < kTile; ++t) {
        const __m256 p = dot_block8(x + (m0 + t) * ldx + b * kBlock, w0, w1, w2, w3);
        acc[t][r] = kPerBlock ? _mm256_fmadd_ps(dr, p, acc[t][r]) : _mm256_add_ps(acc[t][r], p);
      }
    }
  }
  for (int t = 0; t < kTile; ++t) {
    float res[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) {
      res[r] = hsum8(acc[t][r]);
      if (!kPerBlock) res[r] *= static_cast<const float*>(scales)[r];
    }
    store_rows(res, out + t * ldo, nrows, bias);
  }
}

#endif  // FF_X86

// ---- drivers ----

// x (M, K) float32 -> int8 blocks; rows in parallel when there are many (prefill).
Int8Rows quantize_rows(const float* x, int64_t rows, int64_t k) {
  Int8Rows xa;
  xa.blocks = k / kBlock;
  const int64_t n = rows * xa.blocks;
  xa.q.resize(n * kBlock);
  xa.d.resize(n);
  xa.s.resize(n);
  const bool avx2 = use_avx2().load();
  at::parallel_for(0, n, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
#if FF_X86
      if (avx2) {
        quantize_block_avx2(x + i * kBlock, xa.q.data() + i * kBlock, &xa.d[i], &xa.s[i]);
        continue;
      }
#endif
      quantize_block_scalar(x + i * kBlock, xa.q.data() + i * kBlock, &xa.d[i], &xa.s[i]);
    }
  });
  (void)avx2;
  return xa;
}

// The float sum of each block of x, added in index order (the same on every ISA).
std::vector<float> block_sums(const float* x, int64_t rows, int64_t k) {
  const int64_t nb = k / kBlock;
  std::vector<float> sums(rows * nb);
  for (int64_t i = 0; i < rows * nb; ++i) {
    float s = 0.f;
    for (int j = 0; j < kBlock; ++j) s += x[i * kBlock + j];
    sums[i] = s;
  }
  return sums;
}

// Groups of output rows per task: at least kTaskBlocks (x row, weight row, block) triples, so that
// a small product is not split finer than a fork/join (a few microseconds) is worth.
constexpr int64_t kTaskBlocks = 4096;

int64_t group_grain(int64_t nb, int64_t rows, int64_t group_rows) {
  return std::max<int64_t>(1, kTaskBlocks / std::max<int64_t>(1, nb * rows * group_rows));
}

void check_common(const at::Tensor& x, const at::Tensor& qweight, const std::optional<at::Tensor>& bias,
                  int64_t out_features, int64_t k, int64_t group_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x: expected a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) == k, "x: expected ", k, " columns (the packed weight's in_features), got ", x.sizes());
  TORCH_CHECK(qweight.is_contiguous(), "qweight: expected a contiguous tensor");
  const int64_t groups = qweight.size(0);
  TORCH_CHECK(out_features > (groups - 1) * group_rows && out_features <= groups * group_rows,
              "out_features: ", out_features, " does not fit ", groups, " groups of ", group_rows, " rows");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(),
                "bias: expected a contiguous float32 tensor of shape (", out_features, "), got ", bias->sizes());
  }
}

at::Tensor int4_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t out_features, bool int8_activations) {
  TORCH_CHECK(qweight.dim() == 4 && qweight.size(2) == kInt4Rows && qweight.size(3) == 16 &&
                  qweight.scalar_type() == at::kByte,
              "qweight: expected uint8 (groups, blocks, 8, 16), got ", qweight.sizes(), " ", qweight.scalar_type());
  const int64_t groups = qweight.size(0), nb = qweight.size(1);
  TORCH_CHECK(scales.dim() == 4 && scales.size(0) == groups && scales.size(1) == nb && scales.size(2) == 2 &&
                  scales.size(3) == kInt4Rows && scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "scales: expected contiguous float16 (", groups, ", ", nb, ", 2, 8), got ", scales.sizes());
  check_common(x_in, qweight, bias, out_features, nb * kBlock, kInt4Rows);
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = out_features, k = nb * kBlock;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  const uint8_t* qw = qweight.data_ptr<uint8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const bool avx2 = use_avx2().load();
  (void)avx2;
  Int8Rows xa;
  std::vector<float> xsum;
  if (int8_activations) {
    xa = quantize_rows(xp, rows, k);
  } else {
    xsum = block_sums(xp, rows, k);
  }
  // One task: x rows [m0, m0 + tile) against half h (rows 4h..4h+3) of group g.
  auto half_group = [&](int64_t g, int h, int64_t m0, int tile) {
    const int64_t row0 = g * kInt4Rows + h * kGroupRows;
    const uint8_t* w = qw + g * nb * kInt4BlockBytes + h * kGroupRows * 16;
    const uint16_t* s = sc + g * nb * kInt4BlockScales + h * kGroupRows;
    const int64_t nrows = std::min(kGroupRows, n - row0);
    float* o = op + m0 * n + row0;
    const float* bg = bp ? bp + row0 : nullptr;
#if FF_X86
    if (avx2 && int8_activations) {
      switch (tile) {
        case 4: int4_int8act_avx2<4>(w, s, nb, xa, m0, o, n, nrows, bg); return;
        case 3: int4_int8act_avx2<3>(w, s, nb, xa, m0, o, n, nrows, bg); return;
        case 2: int4_int8act_avx2<2>(w, s, nb, xa, m0, o, n, nrows, bg); return;
        default: int4_int8act_avx2<1>(w, s, nb, xa, m0, o, n, nrows, bg); return;
      }
    }
    if (avx2) {
      if (tile == 2) {
        int4_f32act_avx2<2>(w, s, nb, xp, k, xsum.data(), m0, o, n, nrows, bg);
      } else {
        int4_f32act_avx2<1>(w, s, nb, xp, k, xsum.data(), m0, o, n, nrows, bg);
      }
      return;
    }
#endif
    if (int8_activations) {
      int4_int8act_scalar(tile, w, s, nb, xa, m0, o, n, nrows, bg);
    } else {
      int4_f32act_scalar(tile, w, s, nb, xp, k, xsum.data(), m0, o, n, nrows, bg);
    }
  };
  const int64_t row_tile = int8_activations ? kInt8Tile : kFloatTile;
  at::parallel_for(0, groups, group_grain(nb, rows, kInt4Rows), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
#if FF_X86
      if (avx2 && int8_activations && rows == 1) {
        int4_int8act_1x8_avx2(qw + g * nb * kInt4BlockBytes, sc + g * nb * kInt4BlockScales, nb, xa, 0,
                              op + g * kInt4Rows, n - g * kInt4Rows, bp ? bp + g * kInt4Rows : nullptr);
        continue;
      }
#endif
      for (int h = 0; h < 2 && g * kInt4Rows + h * kGroupRows < n; ++h) {
        for (int64_t m0 = 0; m0 < rows; m0 += row_tile) {
          half_group(g, h, m0, static_cast<int>(std::min(row_tile, rows - m0)));
        }
      }
    }
  });
  return out;
}

template <bool kPerBlock>
void int8_linear_impl(const float* xp, int64_t rows, const int8_t* qw, const void* scales, int64_t groups, int64_t nb,
                      float* op, int64_t n, const float* bp, bool int8_activations) {
  const bool avx2 = use_avx2().load();
  (void)avx2;
  // The scales of group g: per block (nb, 4) halves, or per row (4,) floats.
  auto group_scales = [&](int64_t g) -> const void* {
    return kPerBlock ? static_cast<const void*>(static_cast<const uint16_t*>(scales) + g * nb * kGroupRows)
                     : static_cast<const void*>(static_cast<const float*>(scales) + g * kGroupRows);
  };
  if (int8_activations) {
    const Int8Rows xa = quantize_rows(xp, rows, nb * kBlock);
    at::parallel_for(0, groups, group_grain(nb, rows, kGroupRows), [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int8_t* gw = qw + g * nb * kGroupRows * kBlock;
        const void* gs = group_scales(g);
        const int64_t nrows = std::min(kGroupRows, n - g * kGroupRows);
        for (int64_t m0 = 0; m0 < rows; m0 += kInt8Tile) {
          const int tile = static_cast<int>(std::min(kInt8Tile, rows - m0));
          float* o = op + m0 * n + g * kGroupRows;
          const float* bg = bp ? bp + g * kGroupRows : nullptr;
#if FF_X86
          if (avx2) {
            switch (tile) {
              case 4: int8_int8act_avx2<4, kPerBlock>(gw, gs, nb, xa, m0, o, n, nrows, bg); break;
              case 3: int8_int8act_avx2<3, kPerBlock>(gw, gs, nb, xa, m0, o, n, nrows, bg); break;
              case 2: int8_int8act_avx2<2, kPerBlock>(gw, gs, nb, xa, m0, o, n, nrows, bg); break;
              default: int8_int8act_avx2<1, kPerBlock>(gw, gs, nb, xa, m0, o, n, nrows, bg); break;
            }
            continue;
          }
#endif
          int8_int8act_scalar<kPerBlock>(tile, gw, gs, nb, xa, m0, o, n, nrows, bg);
        }
      }
    });
    return;
  }
  at::parallel_for(0, groups, group_grain(nb, rows, kGroupRows), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int8_t* gw = qw + g * nb * kGroupRows * kBlock;
      const void* gs = group_scales(g);
      const int64_t nrows = std::min(kGroupRows, n - g * kGroupRows);
      for (int64_t m0 = 0; m0 < rows; m0 += kFloatTile) {
        const int tile = static_cast<int>(std::min(kFloatTile, rows - m0));
        float* o = op + m0 * n + g * kGroupRows;
        const float* bg = bp ? bp + g * kGroupRows : nullptr;
        const int64_t k = nb * kBlock;
#if FF_X86
        if (avx2) {
          if (tile == 2) {
            int8_f32act_avx2<2, kPerBlock>(gw, gs, nb, xp, k, m0, o, n, nrows, bg);
          } else {
            int8_f32act_avx2<1, kPerBlock>(gw, gs, nb, xp, k, m0, o, n, nrows, bg);
          }
          continue;
        }
#endif
        int8_f32act_scalar<kPerBlock>(tile, gw, gs, nb, xp, k, m0, o, n, nrows, bg);
      }
    }
  });
}

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t out_features, bool int8_activations) {
  TORCH_CHECK(qweight.dim() == 4 && qweight.size(2) == kGroupRows && qweight.size(3) == kBlock &&
                  qweight.scalar_type() == at::kChar,
              "qweight: expected int8 (groups, blocks, 4, 32), got ", qweight.sizes(), " ", qweight.scalar_type());
  const int64_t groups = qweight.size(0), nb = qweight.size(1);
  const bool per_block = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(scales.is_contiguous(), "scales: expected a contiguous tensor");
  if (per_block) {
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == groups && scales.size(1) == nb && scales.size(2) == kGroupRows,
                "scales: expected float16 (", groups, ", ", nb, ", 4) per block, got ", scales.sizes());
  } else {
    TORCH_CHECK(scales.dim() == 1 && scales.size(0) == groups * kGroupRows && scales.scalar_type() == at::kFloat,
                "scales: expected float32 (", groups * kGroupRows, ",) per row, got ", scales.sizes(), " ",
                scales.scalar_type());
  }
  check_common(x_in, qweight, bias, out_features, nb * kBlock, kGroupRows);
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = out_features;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  if (per_block) {
    int8_linear_impl<true>(x.data_ptr<float>(), rows, qweight.data_ptr<int8_t>(),
                           scales.data_ptr<at::Half>(), groups, nb, out.data_ptr<float>(), n, bp, int8_activations);
  } else {
    int8_linear_impl<false>(x.data_ptr<float>(), rows, qweight.data_ptr<int8_t>(), scales.data_ptr<float>(), groups,
                            nb, out.data_ptr<float>(), n, bp, int8_activations);
  }
  return out;
}

int64_t quantized_kernel_isa(int64_t request) {
  if (request == 0) use_avx2().store(false);
  if (request == 1) use_avx2().store(cpu_has_avx2());
  return use_avx2().load() ? 1 : 0;
}

using LinearSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const std::optional<at::Tensor>&, int64_t, bool);

template <const char* kName>
at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const std::optional<at::Tensor>& bias, int64_t out_features, bool int8_activations) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(kName, "").typed<LinearSignature>();
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = op.call(x, qweight, scales, bias, out_features, int8_activations);
  }
  if (torch::autograd::compute_requires_grad(x, bias)) {
    auto error = c10::make_intrusive<torch::autograd::Error>(
        std::string(kName) +
            ": flashformer's quantized linear layers have no backward pass: their weights are integer "
            "buffers. Train or fine-tune the float model, then quantize it.",
        torch::autograd::collect_next_edges(x, bias));
    torch::autograd::set_history(out, error);
  }
  return out;
}

constexpr char kInt4Linear[] = "flashformer::int4_linear";
constexpr char kInt8Linear[] = "flashformer::int8_linear";

}  // namespace

TORCH_LIBRARY_IMPL(flashformer, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
}

TORCH_LIBRARY_IMPL(flashformer, Autograd, m) {
  m.impl("int4_linear", &linear_autograd<kInt4Linear>);
  m.impl("int8_linear", &linear_autograd<kInt8Linear>);
}

// An operator without tensor arguments dispatches to CompositeExplicitAutograd's kernel.
TORCH_LIBRARY_IMPL(flashformer, CompositeExplicitAutograd, m) {
  m.impl("quantized_kernel_isa", &quantized_kernel_isa);
}
