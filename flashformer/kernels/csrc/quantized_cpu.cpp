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
//   flashformer::quantized_kernel_isa(request) -> int: the kernels in use, 0 = scalar, 1 = AVX2,
//       2 = AVX-512 VNNI; request 0..2 switches to that one or the best below it this CPU has (tests
//       compare them), -1 only asks.
//
// Why this shape of kernel (the design of llama.cpp's ggml-cpu AVX2 path, written anew):
// - A decode step reads every weight once per token, so its time is the time to stream the
//   weights. 4-bit blocks are 0.625 bytes per weight instead of 4: the kernel must widen them in
//   registers and never write a float copy of W.
// - int8_activations: x is quantized per block of 32 to int8 once per call (scale d = amax / 127),
//   and each weight block's dot product is an exact integer sum (AVX2: maddubs + madd; AVX-512
//   VNNI: vpdpbusd), then one float multiply-add with the two blocks' scales. Otherwise x stays
//   float32 and the weights are widened to float for FMAs: exact with respect to the dequantized
//   weights, more instructions per weight.
// - Output rows are interleaved (8 for int4, 4 for int8) so a group is one sequential stream and
//   one pass over an x block serves several rows; a tile of x rows (up to 8) shares each block's
//   unpacking. The int4 kernels (and VNNI's int8 kernel) transpose a block so that each output
//   row owns a 32-bit lane: its whole block product forms there, with no horizontal sums
//   (quantized_x86.inc). Side-by-side groups are prefetched: the hardware misses short streams.
// - Batch invariance: every (x row, output row) pair goes through the same operations in the
//   same order whatever M, the tile of x rows it falls in, or the thread that computes it; the
//   float accumulation is over blocks in order. So a row's result does not depend on its batch.
// - The scalar kernels perform the same float operations in the same order as the AVX2 and VNNI
//   ones (std::fma where those have an FMA), so all give the same bits; tests check that here.
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
constexpr int64_t kScalarTile = 4;  // x rows per call of a scalar kernel (any tile gives the same bits)

// Which kernels run: the best this CPU has, or one chosen by quantized_kernel_isa (tests compare them).
enum Isa : int { kScalar = 0, kAvx2 = 1, kVnni = 2 };

int best_isa() {
#if FF_X86
  __builtin_cpu_init();
  const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                    __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
  return avx2 ? (vnni ? kVnni : kAvx2) : kScalar;
#else
  return kScalar;
#endif
}

std::atomic<int>& use_isa() {
  static std::atomic<int> isa{best_isa()};
  return isa;
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
  std::vector<int32_t> offset;  // (M, blocks): -128 * sum_j q[j], VNNI's int8 kernel's starting sum
};

// ---- scalar kernels (any CPU; the reference order of operations) ----

void quantize_block_scalar(const float* x, int8_t* q, float* d, float* s, int32_t* offset) {
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
  *offset = -128 * sum;
}

// The 8-lane horizontal sum in the order of hsum8 below.
inline float hsum8_scalar(const float* a) {
  const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  return (s0 + s2) + (s1 + s3);
}

inline void store_rows(const float* acc, float* out, int64_t nrows, const float* bias) {
  for (int64_t r = 0; r < nrows; ++r) out[r] = bias ? acc[r] + bias[r] : acc[r];
}

// The int8-activation kernels: for an x row and an output row, block b's whole integer dot
// product P (exact: |P| < 2^24), then acc = fma(d_w * d_x, P, acc) over the blocks in order, and
// for int4 acc = fma(m_w, s_x, acc) after each block (the block's minimum times the x block's sum).
// int8 with per-row scales: acc = fma(d_x, P, acc), and the row's scale multiplies the sum.
void int4_int8act_scalar(int tile, const uint8_t* qw, const uint16_t* sc, int64_t nb, const Int8Rows& xa,
                         int64_t m0, float* out, int64_t ldo, int64_t nrows, const float* bias) {
  for (int t = 0; t < tile; ++t) {
    float res[kInt4Rows];
    for (int r = 0; r < kInt4Rows; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t xb = (m0 + t) * nb + b;
        const int8_t* xq = xa.q.data() + xb * kBlock;
        const uint8_t* w = qw + b * kInt4BlockBytes + r * 16;
        int product = 0;
        for (int j = 0; j < 16; ++j) product += (w[j] & 15) * xq[j] + (w[j] >> 4) * xq[j + 16];
        const float scale = half_to_float(sc[b * kInt4BlockScales + r]) * xa.d[xb];
        acc = std::fma(scale, static_cast<float>(product), acc);
        acc = std::fma(half_to_float(sc[b * kInt4BlockScales + kInt4Rows + r]), xa.s[xb], acc);
      }
      res[r] = acc;
    }
    store_rows(res, out + t * ldo, nrows, bias);
  }
}

template <bool kPerBlock>
void int8_int8act_scalar(int tile, const int8_t* qw, const void* scales, int64_t nb, const Int8Rows& xa,
                         int64_t m0, float* out, int64_t ldo, int64_t nrows, const float* bias) {
  for (int t = 0; t < tile; ++t) {
    float res[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t xb = (m0 + t) * nb + b;
        const int8_t* xq = xa.q.data() + xb * kBlock;
        const int8_t* w = qw + (b * kGroupRows + r) * kBlock;
        int product = 0;
        for (int j = 0; j < kBlock; ++j) product += w[j] * xq[j];
        const float scale = kPerBlock
            ? half_to_float(static_cast<const uint16_t*>(scales)[b * kGroupRows + r]) * xa.d[xb]
            : xa.d[xb];
        acc = std::fma(scale, static_cast<float>(product), acc);
      }
      res[r] = kPerBlock ? acc : acc * static_cast<const float*>(scales)[r];
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

// ---- x86 kernels (same operations, 8 or 4 lanes at a time): quantized_x86.inc, twice ----
#if FF_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define FF_VNNI 0
#include "quantized_x86.inc"
#undef FF_VNNI
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
namespace vnni {
#define FF_VNNI 1
#include "quantized_x86.inc"
#undef FF_VNNI
}  // namespace vnni
#pragma GCC pop_options
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
  xa.offset.resize(n);
  const int isa = use_isa().load();
  at::parallel_for(0, n, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
#if FF_X86
      if (isa != kScalar) {  // the same instructions on either: the AVX2 build serves both
        avx2::quantize_block(x + i * kBlock, xa.q.data() + i * kBlock, &xa.d[i], &xa.s[i], &xa.offset[i]);
        continue;
      }
#endif
      quantize_block_scalar(x + i * kBlock, xa.q.data() + i * kBlock, &xa.d[i], &xa.s[i], &xa.offset[i]);
    }
  });
  (void)isa;
  return xa;
}

// x rows per kernel call: what the ISA's kernels keep in registers.
int64_t row_tile(int isa, bool int8_activations) {
#if FF_X86
  if (isa == kVnni) return int8_activations ? vnni::kInt8Tile : vnni::kFloatTile;
  if (isa == kAvx2) return int8_activations ? avx2::kInt8Tile : avx2::kFloatTile;
#endif
  (void)int8_activations;
  return kScalarTile;
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
  const int isa = use_isa().load();
  Int8Rows xa;
  std::vector<float> xsum;
  if (int8_activations) {
    xa = quantize_rows(xp, rows, k);
  } else {
    xsum = block_sums(xp, rows, k);
  }
  // With float activations: x rows [m0, m0 + tile) against half h (rows 4h..4h+3) of group g.
  auto half_group = [&](int64_t g, int h, int64_t m0, int tile) {
    const int64_t row0 = g * kInt4Rows + h * kGroupRows;
    const uint8_t* w = qw + g * nb * kInt4BlockBytes + h * kGroupRows * 16;
    const uint16_t* s = sc + g * nb * kInt4BlockScales + h * kGroupRows;
    const int64_t nrows = std::min(kGroupRows, n - row0);
    float* o = op + m0 * n + row0;
    const float* bg = bp ? bp + row0 : nullptr;
#if FF_X86
    if (isa != kScalar) {
      (isa == kVnni ? vnni::int4_f32act_rows : avx2::int4_f32act_rows)(tile, w, s, nb, xp, k, xsum.data(), m0, o,
                                                                       n, nrows, bg);
      return;
    }
#endif
    int4_f32act_scalar(tile, w, s, nb, xp, k, xsum.data(), m0, o, n, nrows, bg);
  };
  // With int8 activations: x rows [m0, m0 + tile) against the whole group g.
  auto whole_group = [&](int64_t g, int64_t m0, int tile) {
    const uint8_t* w = qw + g * nb * kInt4BlockBytes;
    const uint16_t* s = sc + g * nb * kInt4BlockScales;
    const int64_t nrows = std::min(kInt4Rows, n - g * kInt4Rows);
    float* o = op + m0 * n + g * kInt4Rows;
    const float* bg = bp ? bp + g * kInt4Rows : nullptr;
#if FF_X86
    if (isa != kScalar) {
      (isa == kVnni ? vnni::int4_int8act_rows : avx2::int4_int8act_rows)(tile, w, s, nb, xa, m0, o, n, nrows, bg);
      return;
    }
#endif
    int4_int8act_scalar(tile, w, s, nb, xa, m0, o, n, nrows, bg);
  };
  const int64_t tile_rows = row_tile(isa, int8_activations);
#if FF_X86
  // VNNI: two groups a pass on 512-bit vectors (the same bits as one at a time); an odd last
  // group goes alone.
  if (isa == kVnni && int8_activations) {
    const int64_t pairs = (groups + 1) / 2;
    at::parallel_for(0, pairs, group_grain(nb, rows, 2 * kInt4Rows), [&](int64_t p0, int64_t p1) {
      for (int64_t pair = p0; pair < p1; ++pair) {
        const int64_t g = 2 * pair;
        for (int64_t m0 = 0; m0 < rows; m0 += tile_rows) {
          const int tile = static_cast<int>(std::min(tile_rows, rows - m0));
          if (g + 1 == groups) {
            whole_group(g, m0, tile);
            continue;
          }
          const uint8_t* w = qw + g * nb * kInt4BlockBytes;
          const uint16_t* s = sc + g * nb * kInt4BlockScales;
          vnni::int4_int8act_pair_rows(tile, w, w + nb * kInt4BlockBytes, s, s + nb * kInt4BlockScales, nb, xa, m0,
                                       op + m0 * n + g * kInt4Rows, n, std::min(2 * kInt4Rows, n - g * kInt4Rows),
                                       bp ? bp + g * kInt4Rows : nullptr);
        }
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, groups, group_grain(nb, rows, kInt4Rows), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (int8_activations) {
        for (int64_t m0 = 0; m0 < rows; m0 += tile_rows) {
          whole_group(g, m0, static_cast<int>(std::min(tile_rows, rows - m0)));
        }
        continue;
      }
      for (int h = 0; h < 2 && g * kInt4Rows + h * kGroupRows < n; ++h) {
        for (int64_t m0 = 0; m0 < rows; m0 += tile_rows) {
          half_group(g, h, m0, static_cast<int>(std::min(tile_rows, rows - m0)));
        }
      }
    }
  });
  return out;
}

template <bool kPerBlock>
void int8_linear_impl(const float* xp, int64_t rows, const int8_t* qw, const void* scales, int64_t groups, int64_t nb,
                      float* op, int64_t n, const float* bp, bool int8_activations) {
  const int isa = use_isa().load();
  const int64_t tile_rows = row_tile(isa, int8_activations);
  // The scales of group g: per block (nb, 4) halves, or per row (4,) floats.
  auto group_scales = [&](int64_t g) -> const void* {
    return kPerBlock ? static_cast<const void*>(static_cast<const uint16_t*>(scales) + g * nb * kGroupRows)
                     : static_cast<const void*>(static_cast<const float*>(scales) + g * kGroupRows);
  };
  if (int8_activations) {
    const Int8Rows xa = quantize_rows(xp, rows, nb * kBlock);
#if FF_X86
    if (isa == kVnni) {  // four groups a pass (a last partial four repeats its last group)
      at::parallel_for(0, (groups + 3) / 4, group_grain(nb, rows, 4 * kGroupRows), [&](int64_t q0, int64_t q1) {
        for (int64_t quad = q0; quad < q1; ++quad) {
          const int64_t g = 4 * quad;
          const int8_t* gw[4];
          const void* gs[4];
          for (int i = 0; i < 4; ++i) {
            const int64_t gi = std::min(g + i, groups - 1);
            gw[i] = qw + gi * nb * kGroupRows * kBlock;
            gs[i] = group_scales(gi);
          }
          const int64_t nrows = std::min(4 * kGroupRows, n - g * kGroupRows);
          for (int64_t m0 = 0; m0 < rows; m0 += tile_rows) {
            vnni::int8_int8act_quad_rows<kPerBlock>(static_cast<int>(std::min(tile_rows, rows - m0)), gw, gs, nb, xa,
                                                    m0, op + m0 * n + g * kGroupRows, n, nrows,
                                                    bp ? bp + g * kGroupRows : nullptr);
          }
        }
      });
      return;
    }
#endif
    at::parallel_for(0, groups, group_grain(nb, rows, kGroupRows), [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int8_t* gw = qw + g * nb * kGroupRows * kBlock;
        const void* gs = group_scales(g);
        const int64_t nrows = std::min(kGroupRows, n - g * kGroupRows);
        for (int64_t m0 = 0; m0 < rows; m0 += tile_rows) {
          const int tile = static_cast<int>(std::min(tile_rows, rows - m0));
          float* o = op + m0 * n + g * kGroupRows;
          const float* bg = bp ? bp + g * kGroupRows : nullptr;
#if FF_X86
          if (isa == kAvx2) {
            avx2::int8_int8act_rows<kPerBlock>(tile, gw, gs, nb, xa, m0, o, n, nrows, bg);
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
      for (int64_t m0 = 0; m0 < rows; m0 += tile_rows) {
        const int tile = static_cast<int>(std::min(tile_rows, rows - m0));
        float* o = op + m0 * n + g * kGroupRows;
        const float* bg = bp ? bp + g * kGroupRows : nullptr;
        const int64_t k = nb * kBlock;
#if FF_X86
        if (isa != kScalar) {
          (isa == kVnni ? vnni::int8_f32act_rows<kPerBlock> : avx2::int8_f32act_rows<kPerBlock>)(
              tile, gw, gs, nb, xp, k, m0, o, n, nrows, bg);
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
  if (request >= 0) use_isa().store(std::min<int>(static_cast<int>(request), best_isa()));
  return use_isa().load();
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
