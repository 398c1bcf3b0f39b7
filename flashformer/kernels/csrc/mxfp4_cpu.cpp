// GGUF's MXFP4 blocks (the type gpt-oss ships its experts in) multiplied as the file stores them:
// out = x @ W^T (+ bias), x float32 (M, K), W (N, K) as N rows of K / 32 blocks of 17 bytes, each
// one e8m0 scale byte and 32 e2m1 codes, two a byte (ggml-common.h's block_mxfp4). Nothing is
// repacked: the tensor can be the file's own memory, an expert's rows a slice of its 3-D tensor.
// The operator (its schema in kernels/operators.py, its ATen side in operators_cpu.cpp):
//
//   flashformer::mxfp4_linear(x, blocks, bias, out_features, int8_activations)   blocks uint8 (N, K / 32, 17)
//
// Weights, as gguf's dequantizer computes them (float32): an e2m1 code c is the value v(c) in
// {0, 0.5, 1, 1.5, 2, 3, 4, 6} and its negatives; doubled, the integers kE2m1Doubled below; the
// block's scale is 2^(e - 127), so w = kE2m1Doubled[c] * 2^(e - 128), exact in float32 (a small
// integer times a power of two; e = 0, 1 give subnormal scales, as ggml's e8m0 "half" does).
//
// - int8_activations: x is quantized per block of 32 (products.h's Int8Rows: d = amax / 127,
//   q = round(x / d)). A block's product is then an integer, sumi = sum_j w2[j] * q[j] with w2
//   the doubled values (|sumi| <= 32 * 12 * 127: exact in float32), formed in any order; then one
//   float multiply-add per block, by 2^(e - 128) * dx, into float lane b % 8 (block b), and the 8
//   lanes added at the end in hsum8_scalar's order: the same bits on every ISA. The x86 kernels
//   widen the codes with one table lookup (pshufb) and multiply bytes: AVX2 with maddubs and madd,
//   VNNI with vpdpbusd; 8 blocks' integers become one vector of 8 lanes, one multiply-add.
// - float activations: each block dequantized to 32 floats exactly, and x . w formed in 8 float
//   lanes (lane l: values l, l + 8, l + 16, l + 24 of every block) added at the end.
// - AMX has no kernel of its own here: it runs VNNI's (vector_isa).
// - Batch invariance: a (x row, weight row) pair's operations do not depend on M or the tile.
// - Threads: units of kChunkRows weight rows; x is read in tiles of kTile rows, which stay in L1
//   while the chunk's rows pass over them.

#include <cstring>

#include "packings.h"

namespace {

using namespace flashformer_cpu;

constexpr int64_t kChunkRows = 16;  // weight rows a unit of work takes
constexpr int kTile = 4;            // x rows a weight row passes over at a time

struct Mxfp4Block {  // 17 bytes
  uint8_t e;         // e8m0: the block's scale 2^(e - 127)
  uint8_t qs[16];    // e2m1 codes: byte j's low nibble is value j, its high nibble value j + 16
};
static_assert(sizeof(Mxfp4Block) == kPackings[kMxfp4].group_block_bytes,
              "the struct must match GGUF's MXFP4 block (packings.h) byte for byte");

// e2m1's values doubled, by code: bit 3 the sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6 times 2
alignas(16) constexpr int8_t kE2m1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

#define FF_INLINE __attribute__((always_inline)) inline

// 2^(e - 128): the scale of the doubled values, as ggml's e8m0 "half" (subnormal for e = 0, 1).
FF_INLINE float half_scale(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return scale;
}

FF_INLINE void decode(const Mxfp4Block& blk, int* w) {  // the 32 doubled values
  for (int j = 0; j < 16; ++j) {
    w[j] = kE2m1Doubled[blk.qs[j] & 15];
    w[j + 16] = kE2m1Doubled[blk.qs[j] >> 4];
  }
}

// ---- scalar kernels (any CPU; the reference) ----

// One weight row (nb blocks) against x rows m0 .. m0 + tile - 1: out[t * ld] (+ bias[0]).
void int8act_scalar(int tile, const Mxfp4Block* row, int64_t nb, const Int8Rows& x, int64_t m0, const Output& o) {
  float acc[kTile][8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    int w[kBlock];
    decode(row[b], w);
    const float d = half_scale(row[b].e);
    for (int t = 0; t < tile; ++t) {
      const int64_t xb = (m0 + t) * nb + b;
      const int8_t* xq = x.quants(xb);
      int32_t sumi = 0;
      for (int j = 0; j < kBlock; ++j) sumi += w[j] * xq[j];
      acc[t][b % 8] = std::fma(d * x.d[xb], static_cast<float>(sumi), acc[t][b % 8]);
    }
  }
  for (int t = 0; t < tile; ++t) {
    const float sum = hsum8_scalar(acc[t]);
    o.out[t * o.ld] = o.bias ? sum + o.bias[0] : sum;
  }
}

void f32act_scalar(int tile, const Mxfp4Block* row, int64_t nb, const float* x, int64_t ld, int64_t m0,
                   const Output& o) {
  float acc[kTile][8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    int q[kBlock];
    decode(row[b], q);
    const float d = half_scale(row[b].e);
    float w[kBlock];
    for (int j = 0; j < kBlock; ++j) w[j] = static_cast<float>(q[j]) * d;  // exact: gguf's values
    for (int t = 0; t < tile; ++t) {
      const float* xb = x + (m0 + t) * ld + b * kBlock;
      for (int v = 0; v < kBlock; ++v) acc[t][v % 8] = std::fma(xb[v], w[v], acc[t][v % 8]);
    }
  }
  for (int t = 0; t < tile; ++t) {
    const float sum = hsum8_scalar(acc[t]);
    o.out[t * o.ld] = o.bias ? sum + o.bias[0] : sum;
  }
}

// ---- x86 kernels: mxfp4_x86.inc, twice ----
#if FF_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define FF_VNNI 0
#include "mxfp4_x86.inc"
#undef FF_VNNI
}  // namespace avx2
#pragma GCC pop_options
#endif  // FF_X86

#if FF_BUILDS_VNNI
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
namespace vnni {
#define FF_VNNI 1
#include "mxfp4_x86.inc"
#undef FF_VNNI
}  // namespace vnni
#pragma GCC pop_options
#elif FF_X86
namespace vnni {  // not built (FF_WIDEST_ISA): AVX2's names
using namespace avx2;
}  // namespace vnni
#endif

// One weight row against a tile of x rows, on `isa`'s kernels (kScalar, kAvx2 or kVnni).
void row_tile(int isa, bool int8_activations, int tile, const Mxfp4Block* row, int64_t nb, const ProductX& x,
              int64_t m0, const Output& o) {
#if FF_X86
  if (isa != kScalar) {
    if (int8_activations) {
      (isa == kVnni ? vnni::int8act_rows : avx2::int8act_rows)(tile, row, nb, x.blocks32, m0, o);
    } else {
      (isa == kVnni ? vnni::f32act_rows : avx2::f32act_rows)(tile, row, nb, x.x, x.k, m0, o);
    }
    return;
  }
#endif
  if (int8_activations) {
    int8act_scalar(tile, row, nb, x.blocks32, m0, o);
  } else {
    f32act_scalar(tile, row, nb, x.x, x.k, m0, o);
  }
}

}  // namespace

namespace flashformer_cpu {

int64_t mxfp4_units(const PackedMatrix& w, int64_t rows, bool int8_activations, int isa) {
  (void)rows, (void)int8_activations, (void)isa;
  return (w.n + kChunkRows - 1) / kChunkRows;
}

void mxfp4_run(const PackedMatrix& w, const ProductX& x, const OutputMatrix& out, bool int8_activations, int isa,
               int64_t first, int64_t last) {
  const Mxfp4Block* weights = static_cast<const Mxfp4Block*>(w.data);
  isa = vector_isa(isa);  // AMX: VNNI's kernels
  note_ran(kMxfp4Products, isa);
  for (int64_t c = first; c < last; ++c) {
    const int64_t r0 = c * kChunkRows, r1 = std::min(w.n, r0 + kChunkRows);
    for (int64_t m0 = 0; m0 < x.rows; m0 += kTile) {
      const int tile = static_cast<int>(std::min<int64_t>(kTile, x.rows - m0));
      for (int64_t r = r0; r < r1; ++r) {
        row_tile(isa, int8_activations, tile, weights + r * w.nb, w.nb, x, m0, out.part(m0, r, 1));
      }
    }
  }
}

void mxfp4_dequantize_row(const PackedMatrix& w, int64_t row, float* out) {
  const Mxfp4Block* blocks = static_cast<const Mxfp4Block*>(w.data) + row * w.nb;
  for (int64_t b = 0; b < w.nb; ++b) {
    int q[kBlock];
    decode(blocks[b], q);
    const float d = half_scale(blocks[b].e);
    for (int j = 0; j < kBlock; ++j) out[b * kBlock + j] = static_cast<float>(q[j]) * d;
  }
}

}  // namespace flashformer_cpu
