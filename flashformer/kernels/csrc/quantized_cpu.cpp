// Weight-only quantized matrix products on the CPU: out = x @ W^T (+ bias), x float32 (M, K),
// W stored as 4-bit or 8-bit integers in blocks of 32 along K. Made for decoding (M = 1 to 16);
// prompts (M in the hundreds) take the same kernels, which with int8 activations outrun a float32
// GEMM on the dequantized weights (so there is no second path, and no batch-size-dependent result).
//
// The kernels of the operators that flashformer/kernels/operators.py defines (schemas, fake tensors
// and the PyTorch fallbacks live there; their ATen side and shape checks in operators_cpu.cpp):
//
//   flashformer::int4_linear(x, qweight, scales, bias, out_features, int8_activations)
//       qweight uint8 (G, nb, 8, 16): for each group of 8 output rows and each block of 32 inputs,
//       the 8 rows' 16 bytes of GGUF Q4_1 nibbles (byte j: q[j] low, q[j + 16] high);
//       scales float16 (G, nb, 2, 8): the 8 rows' d, then their m. Weight = d * q + m.
//   flashformer::int5_linear(x, qweight, scales, bias, out_features, int8_activations)
//       qweight uint8 (G, nb, 160): Int5Block below, int4's nibbles and the fifth bits (GGUF Q5_0 /
//       Q5_1); scales as int4's.
//   flashformer::int8_linear(x, qweight, scales, bias, out_features, int8_activations)
//       qweight int8 (G, nb, 4, 32); scales float16 (G, nb, 4) per block (GGUF Q8_0: weight = d * q)
//       or float32 (G * 4,) per output row.
//   flashformer::quantized_kernel_isa(request) -> int: the kernels in use, 0 = scalar, 1 = AVX2,
//       2 = AVX-512 VNNI, 3 = AMX (kquants_amx.inc); request 0..3 switches to that one or the best
//       below it this CPU has (tests compare them), -1 only asks. Every family of kernels follows
//       it (the products here and in kquants_cpu.cpp, the row operations, attention).
//   flashformer::kernels_ran(reset) -> int[]: per family of kernels (quantized_common.h's Family),
//       the ISAs whose build it ran since the last reset, a bit each.
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
// - No backward: the Autograd kernel (operators_cpu.cpp) gives an output that needs a gradient
//   an Error node, which raises when backward reaches it. It is C++ because a Python autograd kernel
//   (torch.library.register_autograd) adds a fixed cost to every call, even under no_grad, as
//   large as a small product's whole time (docs/benchmarks.md, "Packed layouts and call costs").

#include <cstring>
#include <type_traits>
#include <vector>

#include "packings.h"
#include "quantized_blocks.h"

namespace {

using namespace flashformer_cpu;

constexpr int64_t kScalarTile = 4;  // x rows per call of a scalar kernel (any tile gives the same bits)
constexpr int64_t kNibblePanelMinRows = 16;  // x rows from which the int4 / int5 kernels read a panel

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

// The int8-activation kernels: for an x row and an output row, block b's whole integer dot
// product P (exact: |P| < 2^24), then acc = fma(d_w * d_x, P, acc) over the blocks in order, and
// for int4 acc = fma(m_w, s_x, acc) after each block (the block's minimum times the x block's sum).
// int8 with per-row scales: acc = fma(d_x, P, acc), and the row's scale multiplies the sum.
// Row r's 32 quants of a block, in input order.
inline void block_quants(const Int4Block& block, int r, int* q) {
  for (int j = 0; j < 16; ++j) q[j] = block.qs[r][j] & 15, q[j + 16] = block.qs[r][j] >> 4;
}
inline void block_quants(const Int5Block& block, int r, int* q) {
  const uint32_t h = block.qh[r];
  for (int j = 0; j < 16; ++j) {
    const int bit = 8 * (j % 4) + j / 4;  // see Int5Block
    q[j] = (block.qs[r][j] & 15) | (((h >> bit) & 1) << 4);
    q[j + 16] = (block.qs[r][j] >> 4) | (((h >> (bit + 4)) & 1) << 4);
  }
}

template <class Block>
void nibble_int8act_scalar(int tile, const NibbleWeights<Block>& w, const Int8Rows& x, int64_t m0, const Output& o) {
  for (int t = 0; t < tile; ++t) {
    float res[kInt4Rows];
    for (int r = 0; r < kInt4Rows; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < w.nb; ++b) {
        const int64_t xb = (m0 + t) * w.nb + b;
        const int8_t* xq = x.quants(xb);
        int q[kBlock];
        block_quants(w.blocks[b], r, q);
        int product = 0;
        for (int j = 0; j < kBlock; ++j) product += q[j] * xq[j];
        const float scale = half_to_float(w.scales[b].d[r]) * x.d[xb];
        acc = std::fma(scale, static_cast<float>(product), acc);
        acc = std::fma(half_to_float(w.scales[b].m[r]), x.s[xb], acc);
      }
      res[r] = acc;
    }
    store_rows(res, o, t);
  }
}

template <bool kPerBlock>
void int8_int8act_scalar(int tile, const Int8Weights& w, const Int8Rows& x, int64_t m0, const Output& o) {
  for (int t = 0; t < tile; ++t) {
    float res[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < w.nb; ++b) {
        const int64_t xb = (m0 + t) * w.nb + b;
        const int8_t* xq = x.quants(xb);
        const int8_t* qs = w.blocks[b].qs[r];
        int product = 0;
        for (int j = 0; j < kBlock; ++j) product += qs[j] * xq[j];
        const float scale = kPerBlock ? half_to_float(w.block_scales[b].d[r]) * x.d[xb] : x.d[xb];
        acc = std::fma(scale, static_cast<float>(product), acc);
      }
      res[r] = kPerBlock ? acc : acc * w.row_scales->d[r];
    }
    store_rows(res, o, t);
  }
}

// The float-activation kernels: per block and row, 8 lanes of x[j] * w[j] chained with FMAs over
// the block's 4 slices of 8, scaled into 8 lane accumulators; an int4 row's minimums multiply the
// block's float sum of x, accumulated apart and added after the lanes' sum.
template <class Block>
void nibble_f32act_scalar(int tile, const NibbleWeights<Block>& w, const FloatRows& x, int64_t m0, const Output& o) {
  for (int t = 0; t < tile; ++t) {
    const float* xr = x.x + (m0 + t) * x.ld;
    float acc[kGroupRows][8] = {};
    float acc_min[kGroupRows] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t b = 0; b < w.nb; ++b) {
      const Int4Scales& scales = w.scales[b];
      for (int r = 0; r < kGroupRows; ++r) {
        acc_min[r] = std::fma(half_to_float(scales.m[w.first_row + r]), x.sums[(m0 + t) * w.nb + b], acc_min[r]);
      }
      for (int r = 0; r < kGroupRows; ++r) {
        int qi[kBlock];
        block_quants(w.blocks[b], static_cast<int>(w.first_row) + r, qi);
        float q[kBlock];
        for (int j = 0; j < kBlock; ++j) q[j] = static_cast<float>(qi[j]);
        const float d = half_to_float(scales.d[w.first_row + r]);
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
    store_rows(res, o, t);
  }
}

template <bool kPerBlock>
void int8_f32act_scalar(int tile, const Int8Weights& w, const FloatRows& x, int64_t m0, const Output& o) {
  for (int t = 0; t < tile; ++t) {
    const float* xr = x.x + (m0 + t) * x.ld;
    float acc[kGroupRows][8] = {};
    for (int64_t b = 0; b < w.nb; ++b) {
      for (int r = 0; r < kGroupRows; ++r) {
        const int8_t* qs = w.blocks[b].qs[r];
        const float* xb = xr + b * kBlock;
        const float d = kPerBlock ? half_to_float(w.block_scales[b].d[r]) : 1.f;
        for (int l = 0; l < 8; ++l) {
          float p = xb[l] * static_cast<float>(qs[l]);
          p = std::fma(xb[8 + l], static_cast<float>(qs[8 + l]), p);
          p = std::fma(xb[16 + l], static_cast<float>(qs[16 + l]), p);
          p = std::fma(xb[24 + l], static_cast<float>(qs[24 + l]), p);
          acc[r][l] = kPerBlock ? std::fma(d, p, acc[r][l]) : acc[r][l] + p;
        }
      }
    }
    float res[kGroupRows];
    for (int r = 0; r < kGroupRows; ++r) {
      res[r] = hsum8_scalar(acc[r]);
      if (!kPerBlock) res[r] *= w.row_scales->d[r];
    }
    store_rows(res, o, t);
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

#endif  // FF_X86

#if FF_BUILDS_VNNI
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
namespace vnni {
#define FF_VNNI 1
#include "quantized_x86.inc"
#undef FF_VNNI
}  // namespace vnni
#pragma GCC pop_options
#elif FF_X86
namespace vnni {  // not built (FF_WIDEST_ISA): AVX2's names, and traps for VNNI's own kernels
using namespace avx2;
template <class Block, class... Args>
void nibble_int8act_pair_rows(Args&&...) { __builtin_trap(); }
template <bool kPerBlock, class... Args>
void int8_int8act_quad_rows(Args&&...) { __builtin_trap(); }
}  // namespace vnni
#endif

#if FF_BUILDS_AMX
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")
namespace amx {
#include "quantized_amx.inc"
}  // namespace amx
#pragma GCC pop_options
#elif FF_X86
namespace amx {  // not built (FF_WIDEST_ISA)
template <class... Args>
void nibble_units(Args&&...) { __builtin_trap(); }
template <class... Args>
void int8_units(Args&&...) { __builtin_trap(); }
}  // namespace amx
#endif

// Whether a product runs on AMX's tiles (quantized_amx.inc): int8 activations and from
// kAmxMinRows x rows. Below, the unit's packing (once per product, weights streamed from memory)
// costs more than the tiles save: SmolLM2-135M Q4_1 in the native decoder, one thread, its up
// projections: AMX ~3.7 ms + 0.26 ms per x row, VNNI ~0.65 ms + 0.49 ms (even at ~13 rows;
// docs/benchmarks.md).
constexpr int64_t kAmxMinRows = 16;

bool on_amx_tiles(int64_t rows, bool int8_activations, int isa) {
  return FF_X86 && isa == kAmx && int8_activations && rows >= kAmxMinRows;
}

// ---- drivers: a product's units (products.h) ----

// x rows per kernel call: what the ISA's kernels keep in registers.
int64_t row_tile(int isa, bool int8_activations) {
#if FF_X86
  if (isa == kVnni) return int8_activations ? vnni::kInt8Tile : vnni::kFloatTile;
  if (isa == kAvx2) return int8_activations ? avx2::kInt8Tile : avx2::kFloatTile;
#endif
  (void)int8_activations;
  return kScalarTile;
}

// The packed matrices, and the part of one a kernel reads.
template <class Block>
struct NibbleMatrix {
  const Block* blocks;       // (groups, nb)
  const Int4Scales* scales;  // (groups, nb)
  int64_t groups, nb;
  explicit NibbleMatrix(const PackedMatrix& w)
      : blocks(static_cast<const Block*>(w.data)), scales(static_cast<const Int4Scales*>(w.scales)),
        groups(w.groups), nb(w.nb) {}
  NibbleWeights<Block> group(int64_t g, int64_t first_row = 0) const {
    return {blocks + g * nb, scales + g * nb, nb, first_row};
  }
};

struct Int8Matrix {
  const Int8Block* blocks;              // (groups, nb)
  const Int8BlockScales* block_scales;  // (groups, nb), or nullptr
  const Int8RowScales* row_scales;      // (groups,), or nullptr
  int64_t groups, nb;
  explicit Int8Matrix(const PackedMatrix& w)
      : blocks(static_cast<const Int8Block*>(w.data)),
        block_scales(w.packing == kInt8PerBlock ? static_cast<const Int8BlockScales*>(w.scales) : nullptr),
        row_scales(w.packing == kInt8PerRow ? static_cast<const Int8RowScales*>(w.scales) : nullptr),
        groups(w.groups), nb(w.nb) {}
  Int8Weights group(int64_t g) const {
    return {blocks + g * nb, block_scales ? block_scales + g * nb : nullptr, row_scales ? row_scales + g : nullptr, nb};
  }
};

// int4 and int5 (one driver, their blocks' own kernels). Units: with int8 activations on AVX2 and
// a prompt's rows, a group unpacked into a panel once for every tile of x rows; on VNNI two
// groups a unit on 512-bit vectors (an odd last group alone); otherwise a group a unit. VNNI's
// two-group kernel was as fast as a panel (the figures in docs/benchmarks.md, "Q5_0 and K-quant
// kernels"). Each gives the scalar kernels' bits.
enum class NibblePlan { kGroups, kPanels, kPairs };

NibblePlan nibble_plan(int64_t rows, bool int8_activations, int isa) {
#if FF_X86
  if (isa == kAvx2 && int8_activations && rows >= kNibblePanelMinRows) return NibblePlan::kPanels;
  if (isa == kVnni && int8_activations) return NibblePlan::kPairs;
#endif
  (void)rows, (void)int8_activations, (void)isa;
  return NibblePlan::kGroups;
}

template <class Block>
void nibble_run_block(const PackedMatrix& packed, const ProductX& x, const OutputMatrix& result, bool int8_activations,
                      int isa, int64_t first, int64_t last) {
  const NibbleMatrix<Block> weights(packed);
  const int64_t rows = x.rows, n = result.n, nb = weights.nb, groups = weights.groups;
  const Int8Rows& xa = x.blocks32;
  const FloatRows xf{x.x, x.k, x.sums32};
  // With float activations: x rows [m0, m0 + tile) against half h (rows 4h..4h+3) of group g.
  auto half_group = [&](int64_t g, int h, int64_t m0, int tile) {
    const NibbleWeights<Block> w = weights.group(g, h * kGroupRows);
    const Output o = result.part(m0, g * kInt4Rows + h * kGroupRows, kGroupRows);
#if FF_X86
    if (isa != kScalar) {
      (isa == kVnni ? vnni::nibble_f32act_rows<Block> : avx2::nibble_f32act_rows<Block>)(tile, w, xf, m0, o);
      return;
    }
#endif
    nibble_f32act_scalar(tile, w, xf, m0, o);
  };
  // With int8 activations: x rows [m0, m0 + tile) against the whole group g.
  auto whole_group = [&](int64_t g, int64_t m0, int tile) {
    const NibbleWeights<Block> w = weights.group(g);
    const Output o = result.part(m0, g * kInt4Rows, kInt4Rows);
#if FF_X86
    if (isa != kScalar) {
      (isa == kVnni ? vnni::nibble_int8act_rows<Block> : avx2::nibble_int8act_rows<Block>)(tile, w, xa, m0, o);
      return;
    }
#endif
    nibble_int8act_scalar(tile, w, xa, m0, o);
  };
  const int64_t tile_rows = row_tile(isa, int8_activations);
  const NibblePlan plan = nibble_plan(rows, int8_activations, isa);
#if FF_X86
  if (plan == NibblePlan::kPanels) {
    // aligned by hand to the vectors' 32 bytes: a std::vector of the AVX type was not
    std::vector<uint8_t> scratch((nb + 1) * sizeof(avx2::NibbleBlock));
    auto* panel =
        reinterpret_cast<avx2::NibbleBlock*>((reinterpret_cast<uintptr_t>(scratch.data()) + 31) & ~uintptr_t{31});
    for (int64_t g = first; g < last; ++g) {
      avx2::nibble_unpack_panel(weights.group(g), panel);
      for (int64_t m0 = 0; m0 < rows; m0 += tile_rows) {
        const int tile = static_cast<int>(std::min(tile_rows, rows - m0));
        avx2::nibble_panel_int8act_rows<Block::kFiveBit>(tile, panel, nb, xa, m0,
                                                         result.part(m0, g * kInt4Rows, kInt4Rows));
      }
    }
    return;
  }
  if (plan == NibblePlan::kPairs) {
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t g = 2 * pair;
      for (int64_t m0 = 0; m0 < rows; m0 += tile_rows) {
        const int tile = static_cast<int>(std::min(tile_rows, rows - m0));
        if (g + 1 == groups) {
          whole_group(g, m0, tile);
          continue;
        }
        vnni::nibble_int8act_pair_rows<Block>(tile, weights.group(g), weights.group(g + 1), xa, m0,
                                              result.part(m0, g * kInt4Rows, 2 * kInt4Rows));
      }
    }
    return;
  }
#endif
  (void)groups;
  for (int64_t g = first; g < last; ++g) {
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
}

// int8: on VNNI with int8 activations four groups a unit (a last partial four repeats its last
// group), otherwise a group a unit.
bool int8_quads(bool int8_activations, int isa) { return int8_activations && isa == kVnni; }

template <bool kPerBlock>
void int8_run_scales(const PackedMatrix& packed, const ProductX& x, const OutputMatrix& result, bool int8_activations,
                     int isa, int64_t first, int64_t last) {
  const Int8Matrix weights(packed);
  const int64_t rows = x.rows, groups = weights.groups;
  const int64_t tile_rows = row_tile(isa, int8_activations);
  const Int8Rows& xa = x.blocks32;
#if FF_X86
  if (int8_quads(int8_activations, isa)) {
    for (int64_t quad = first; quad < last; ++quad) {
      const int64_t g = 4 * quad;
      Int8Weights four[4];
      for (int i = 0; i < 4; ++i) four[i] = weights.group(std::min(g + i, groups - 1));
      for (int64_t m0 = 0; m0 < rows; m0 += tile_rows) {
        vnni::int8_int8act_quad_rows<kPerBlock>(static_cast<int>(std::min(tile_rows, rows - m0)), four, xa, m0,
                                                result.part(m0, g * kGroupRows, 4 * kGroupRows));
      }
    }
    return;
  }
#endif
  (void)groups;
  const FloatRows xf{x.x, x.k, nullptr};
  for (int64_t g = first; g < last; ++g) {
    const Int8Weights w = weights.group(g);
    for (int64_t m0 = 0; m0 < rows; m0 += tile_rows) {
      const int tile = static_cast<int>(std::min(tile_rows, rows - m0));
      const Output o = result.part(m0, g * kGroupRows, kGroupRows);
      if (int8_activations) {
#if FF_X86
        if (isa == kAvx2) {
          avx2::int8_int8act_rows<kPerBlock>(tile, w, xa, m0, o);
          continue;
        }
#endif
        int8_int8act_scalar<kPerBlock>(tile, w, xa, m0, o);
        continue;
      }
#if FF_X86
      if (isa != kScalar) {
        (isa == kVnni ? vnni::int8_f32act_rows<kPerBlock> : avx2::int8_f32act_rows<kPerBlock>)(tile, w, xf, m0, o);
        continue;
      }
#endif
      int8_f32act_scalar<kPerBlock>(tile, w, xf, m0, o);
    }
  }
}

}  // namespace

namespace flashformer_cpu {

void quantize_blocks32(const float* x, int64_t first, int64_t last, Int8Rows& out) {
  const int isa = use_isa().load();
  note_ran(kQuantizingX, isa == kScalar ? kScalar : kAvx2);
  for (int64_t i = first; i < last; ++i) {
#if FF_X86
    if (isa != kScalar) {  // the same instructions on either: the AVX2 build serves both
      avx2::quantize_block(x + i * kBlock, out.q + i * kBlock, &out.d[i], &out.s[i], &out.offset[i]);
      continue;
    }
#endif
    quantize_block_scalar(x + i * kBlock, out.q + i * kBlock, &out.d[i], &out.s[i], &out.offset[i]);
  }
  (void)isa;
}

void int8_residual(const float* x, int64_t rows, int64_t k, int64_t block, float* out) {
  const int64_t nb = k / block;
  // a row's blocks, this thread's (the decoder's head calls it every step: no allocation there)
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> d, s;
  thread_local std::vector<int32_t> offset;
  thread_local std::vector<int16_t> sums;
  q.resize(k), d.resize(nb), s.resize(nb), offset.resize(nb), sums.resize(nb * 16);
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = x + m * k;
    if (block == kSuper) {
      SuperRows blocks{nb, q.data(), d.data(), sums.data()};
      quantize_blocks256(row, 0, nb, blocks);
    } else {
      Int8Rows blocks{nb, q.data(), d.data(), s.data(), offset.data()};
      quantize_blocks32(row, 0, nb, blocks);
    }
    for (int64_t i = 0; i < k; ++i) out[m * k + i] = row[i] - d[i / block] * static_cast<float>(q[i]);
  }
}

// The float sum of each block of x, added in index order (the same on every ISA).
void sum_blocks32(const float* x, int64_t first, int64_t last, float* sums) {
  for (int64_t i = first; i < last; ++i) {
    float s = 0.f;
    for (int j = 0; j < kBlock; ++j) s += x[i * kBlock + j];
    sums[i] = s;
  }
}

int64_t nibble_units(const PackedMatrix& w, int64_t rows, bool int8_activations, int isa) {
  if (on_amx_tiles(rows, int8_activations, isa)) return (w.groups + 1) / 2;
  return nibble_plan(rows, int8_activations, vector_isa(isa)) == NibblePlan::kPairs ? (w.groups + 1) / 2 : w.groups;
}

template <Packing kPacking>
void nibble_run(const PackedMatrix& w, const ProductX& x, const OutputMatrix& out, bool int8_activations, int isa,
                int64_t first, int64_t last) {
  using Block = NibbleBlock<kPacking>;
#if FF_X86
  if (on_amx_tiles(x.rows, int8_activations, isa)) {
    note_ran(kNibbleProducts, kAmx);
    return amx::nibble_units(static_cast<const Block*>(w.data), static_cast<const Int4Scales*>(w.scales), w.groups,
                             w.nb, x.blocks32, x.rows, out, first, last);
  }
#endif
  isa = vector_isa(isa);
  note_ran(kNibbleProducts, isa);
  nibble_run_block<Block>(w, x, out, int8_activations, isa, first, last);
}
template void nibble_run<kInt4>(const PackedMatrix&, const ProductX&, const OutputMatrix&, bool, int, int64_t, int64_t);
template void nibble_run<kInt5>(const PackedMatrix&, const ProductX&, const OutputMatrix&, bool, int, int64_t, int64_t);

int64_t int8_units(const PackedMatrix& w, int64_t rows, bool int8_activations, int isa) {
  if (on_amx_tiles(rows, int8_activations, isa)) return (w.groups + 3) / 4;
  return int8_quads(int8_activations, vector_isa(isa)) ? (w.groups + 3) / 4 : w.groups;
}

template <Packing kPacking>
void int8_run(const PackedMatrix& w, const ProductX& x, const OutputMatrix& out, bool int8_activations, int isa,
              int64_t first, int64_t last) {
  constexpr bool kPerBlock = kPacking == kInt8PerBlock;
#if FF_X86
  if (on_amx_tiles(x.rows, int8_activations, isa)) {
    note_ran(kInt8Products, kAmx);
    return amx::int8_units(static_cast<const Int8Block*>(w.data),
                           kPerBlock ? static_cast<const Int8BlockScales*>(w.scales) : nullptr,
                           kPerBlock ? nullptr : static_cast<const float*>(w.scales), w.groups, w.nb, x.blocks32,
                           x.rows, out, first, last);
  }
#endif
  isa = vector_isa(isa);
  note_ran(kInt8Products, isa);
  int8_run_scales<kPerBlock>(w, x, out, int8_activations, isa, first, last);
}
template void int8_run<kInt8PerBlock>(const PackedMatrix&, const ProductX&, const OutputMatrix&, bool, int, int64_t,
                                      int64_t);
template void int8_run<kInt8PerRow>(const PackedMatrix&, const ProductX&, const OutputMatrix&, bool, int, int64_t,
                                    int64_t);

// Row `row` of the matrix as float32 (k values): d * q + m (int4, int5), q * d (int8), as the
// Python dequantizers compute them (an embedding's rows).
template <Packing kPacking>
void nibble_dequantize_row(const PackedMatrix& w, int64_t row, float* out) {
  const int64_t g = row / kInt4Rows;
  const int r = static_cast<int>(row % kInt4Rows);
  const auto* scales = static_cast<const Int4Scales*>(w.scales) + g * w.nb;
  for (int64_t b = 0; b < w.nb; ++b) {
    int q[kBlock];
    block_quants(static_cast<const NibbleBlock<kPacking>*>(w.data)[g * w.nb + b], r, q);
    const float d = half_to_float(scales[b].d[r]), m = half_to_float(scales[b].m[r]);
    for (int j = 0; j < kBlock; ++j) out[b * kBlock + j] = d * static_cast<float>(q[j]) + m;
  }
}
template void nibble_dequantize_row<kInt4>(const PackedMatrix&, int64_t, float*);
template void nibble_dequantize_row<kInt5>(const PackedMatrix&, int64_t, float*);

template <Packing kPacking>
void int8_dequantize_row(const PackedMatrix& w, int64_t row, float* out) {
  const int64_t g = row / kGroupRows;
  const int r = static_cast<int>(row % kGroupRows);
  const Int8Block* blocks = static_cast<const Int8Block*>(w.data) + g * w.nb;
  for (int64_t b = 0; b < w.nb; ++b) {
    const float d = kPacking == kInt8PerRow
                        ? static_cast<const float*>(w.scales)[row]
                        : half_to_float(static_cast<const Int8BlockScales*>(w.scales)[g * w.nb + b].d[r]);
    for (int j = 0; j < kBlock; ++j) out[b * kBlock + j] = static_cast<float>(blocks[b].qs[r][j]) * d;
  }
}
template void int8_dequantize_row<kInt8PerBlock>(const PackedMatrix&, int64_t, float*);
template void int8_dequantize_row<kInt8PerRow>(const PackedMatrix&, int64_t, float*);

}  // namespace flashformer_cpu
