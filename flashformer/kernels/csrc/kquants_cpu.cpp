// GGUF's K-quant blocks (Q4_K, Q5_K, Q6_K) multiplied as the file stores them: out = x @ W^T
// (+ bias), x float32 (M, K), W (N, K) as N rows of K / 256 blocks, each block the file's bytes
// (the structs below are ggml-common.h's block_q4_K, block_q5_K, block_q6_K, field for field).
// Nothing is repacked: a row is one sequential stream, and the tensor can be the file's own
// memory. The kernels of the operators (schemas and fallbacks in kernels/operators.py, their ATen side in
// operators_cpu.cpp):
//
//   flashformer::q4_k_linear(x, blocks, bias, out_features, int8_activations)   blocks uint8 (N, K / 256, 144)
//   flashformer::q5_k_linear(...)                                                 (N, K / 256, 176)
//   flashformer::q6_k_linear(...)                                                 (N, K / 256, 210)
//
// Weights, as gguf's dequantizer computes them (float32): Q4_K and Q5_K: d * sc[j] * q - dmin * m[j]
// for sub-block j of 32 values (sc, m 6-bit), q 4- or 5-bit; Q6_K: d * sc[i] * (q - 32) for
// sub-block i of 16 (sc int8), q 6-bit.
//
// - int8_activations: x is quantized per block of 256 (llama.cpp's Q8_K: one float scale
//   d = amax / 127, q = round(x / d), and each 16 quants' sum). A block's product is then
//   integers: sumi = sum_j sc[j] * (q . x)_j and summ = sum_i m[i / 2] * xsum_i (Q6_K:
//   sum_i sc[i] * xsum_i, the -32's), whole and exact whatever the order they are added in;
//   then per block one float multiply-add each, by d * dx and -dmin * dx (Q6_K: -32 d * dx), in
//   block order, and the two sums added at the end: the same on every ISA and in every kernel.
//   Rows of x from 16-32 (a prompt; products.h, kquant_panel_min_rows) take the panel kernels
//   (kquants_panel_x86.inc): 16 or 8 weight rows unpacked once per call into a transposed panel,
//   each row in a vector lane, so that one x word broadcast serves them all. Fewer x rows
//   (decoding, a speculative verify, a small batch) take 8 weight rows at a time (kquants_x86.inc):
//   their scales unpacked and each block made ready once for a tile of up to 8 x rows, their float
//   steps taken in 8-lane vectors (lane r: row r); the row kernels, which form the same integers,
//   take a matrix's last rows past a multiple of 8 and the float activations.
// - float activations: each block is dequantized to 256 floats exactly as gguf does, and x . w is
//   formed in 8 float lanes (lane l: values l, l + 8, ...) added at the end; exact with respect to
//   the dequantized weights, and the same bits on every ISA.
// - On AMX (kquants_amx.inc) the panel's integers come from int8 tile multiplications: the same
//   integers, the same float steps, so the same bits.
// - Batch invariance: a (x row, weight row) pair's operations do not depend on M or the tile.
// - Threads: at::parallel_for over chunks of weight rows; x is read in tiles of rows that stay in
//   L1 while a chunk of weight rows (in L2) passes over them.

#include <cstddef>
#include <cstring>
#include <type_traits>
#include <utility>

#include "packings.h"

namespace {

using namespace flashformer_cpu;

constexpr int64_t kChunkRows = 16;  // weight rows a task's x tiles pass over (in L2, the tile in L1)
constexpr int kScalarTile = 4;      // x rows per scalar kernel call (any tile gives the same bits)
constexpr int kRows8Tile = 8;       // x rows a block's 8 ready weight rows serve (kquant_int8act_rows8)

// ---- the blocks, as in the file ----

struct Q4KBlock {       // 144 bytes
  uint16_t d;           // float16: the scales' scale
  uint16_t dmin;        // float16: the minimums' scale
  uint8_t scales[12];   // 8 6-bit scales and 8 6-bit minimums, packed (see unpack_scales)
  uint8_t qs[128];      // 32 bytes per 64 values: low nibbles values 0..31, high nibbles 32..63
};
struct Q5KBlock {       // 176 bytes
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[32];       // fifth bits: byte l, bit j belongs to value 32 j + l
  uint8_t qs[128];      // the low 4 bits, as Q4_K's
};
struct Q6KBlock {       // 210 bytes
  uint8_t ql[128];      // low 4 bits: per 128 values, 64 bytes: bytes 0..31 low nibbles values 0..31,
                        // bytes 32..63 values 32..63, their high nibbles values 64..95, 96..127
  uint8_t qh[64];       // high 2 bits: per 128 values, byte l bits 2k, 2k + 1 belong to value 32 k + l
  int8_t scales[16];    // one per 16 values
  uint16_t d;           // float16
};
static_assert(sizeof(Q4KBlock) == kPackings[kQ4K].group_block_bytes &&
                  sizeof(Q5KBlock) == kPackings[kQ5K].group_block_bytes &&
                  sizeof(Q6KBlock) == kPackings[kQ6K].group_block_bytes,
              "the structs must match GGUF's blocks (packings.h) byte for byte");
template <Packing kPacking>  // kQ4K, kQ5K, kQ6K
using KQuantBlock = std::conditional_t<kPacking == kQ4K, Q4KBlock, std::conditional_t<kPacking == kQ5K, Q5KBlock, Q6KBlock>>;

// Q4_K / Q5_K's 12 bytes -> 8 scales and 8 minimums, 6 bits each: the first four of each are the
// low 6 bits of bytes 0..3 (scales) and 4..7 (minimums); the last four take their low 4 bits from
// bytes 8..11 (scales low nibbles, minimums high nibbles) and their top 2 bits from the top bits
// of bytes 0..3 and 4..7. Four at a time in 32-bit words.
struct ScalesMins {
  uint64_t sc;  // byte j: scale j
  uint64_t m;   // byte j: minimum j
  int scale(int j) const { return static_cast<int>((sc >> (8 * j)) & 0xFF); }
  int min(int j) const { return static_cast<int>((m >> (8 * j)) & 0xFF); }
};
#define FF_INLINE __attribute__((always_inline)) inline
FF_INLINE ScalesMins unpack_scales(const uint8_t* bytes) {
  uint32_t w[3];
  std::memcpy(w, bytes, sizeof(w));
  const uint32_t low6 = 0x3F3F3F3F, low4 = 0x0F0F0F0F, top2 = 0x30303030;
  const uint64_t sc_low = w[0] & low6, sc_high = (w[2] & low4) | ((w[0] >> 2) & top2);
  const uint64_t m_low = w[1] & low6, m_high = ((w[2] >> 4) & low4) | ((w[1] >> 2) & top2);
  return {sc_low | (sc_high << 32), m_low | (m_high << 32)};
}

// ---- what a kernel reads ----

// x (M, K) float32 as it is.
struct FloatX {
  const float* x;
  int64_t ld;  // K
};

// ---- per type: the float step of a block's integer product, and its dequantization ----
// Inlined into every kernel: a call from AVX code into code compiled for baseline x86 (SSE)
// stalls on the transition of the vector registers' upper halves (80 % of a Q4_K call's time).
// A block adds d * dx * sumi + min_factor * summ (see the top of the file), from the block's float16
// factors widened (d, dmin: half_to_float here, F16C in the x86 kernels, exact both).

template <class Block>
struct KQuant;

template <>
struct KQuant<Q4KBlock> {
  static uint16_t d_bits(const Q4KBlock& blk) { return blk.d; }
  static uint16_t dmin_bits(const Q4KBlock& blk) { return blk.dmin; }
  FF_INLINE static float min_factor(float, float dmin, float dx) { return -(dmin * dx); }
  FF_INLINE static void scales16(const ScalesMins& sm, int* scale16, int* min16) {
    for (int i = 0; i < 16; ++i) scale16[i] = sm.scale(i / 2), min16[i] = sm.min(i / 2);
  }
  // value v's quant, its sub-block of 16's scale and minimum weight, for the scalar kernel
  FF_INLINE static void decode(const Q4KBlock& blk, int* q, int* scale16, int* min16) {
    const ScalesMins sm = unpack_scales(blk.scales);
    for (int v = 0; v < kSuper; ++v) {
      const uint8_t byte = blk.qs[32 * (v / 64) + v % 32];
      q[v] = (v / 32) % 2 ? byte >> 4 : byte & 15;
    }
    scales16(sm, scale16, min16);
  }
  FF_INLINE static void dequantize(const Q4KBlock& blk, float* w) {
    int q[kSuper], scale16[16], min16[16];
    decode(blk, q, scale16, min16);
    const float d = half_to_float(blk.d), dmin = half_to_float(blk.dmin);
    for (int v = 0; v < kSuper; ++v) {
      const float ds = d * static_cast<float>(scale16[v / 16]), dm = dmin * static_cast<float>(min16[v / 16]);
      w[v] = ds * static_cast<float>(q[v]) - dm;  // gguf: (d * sc) * q - (dmin * m), in float32
    }
  }
};

template <>
struct KQuant<Q5KBlock> {
  static uint16_t d_bits(const Q5KBlock& blk) { return blk.d; }
  static uint16_t dmin_bits(const Q5KBlock& blk) { return blk.dmin; }
  FF_INLINE static float min_factor(float, float dmin, float dx) { return -(dmin * dx); }
  FF_INLINE static void scales16(const ScalesMins& sm, int* scale16, int* min16) {
    for (int i = 0; i < 16; ++i) scale16[i] = sm.scale(i / 2), min16[i] = sm.min(i / 2);
  }
  FF_INLINE static void decode(const Q5KBlock& blk, int* q, int* scale16, int* min16) {
    const ScalesMins sm = unpack_scales(blk.scales);
    for (int v = 0; v < kSuper; ++v) {
      const uint8_t byte = blk.qs[32 * (v / 64) + v % 32];
      const int high = (blk.qh[v % 32] >> (v / 32)) & 1;
      q[v] = ((v / 32) % 2 ? byte >> 4 : byte & 15) | (high << 4);
    }
    scales16(sm, scale16, min16);
  }
  FF_INLINE static void dequantize(const Q5KBlock& blk, float* w) {
    int q[kSuper], scale16[16], min16[16];
    decode(blk, q, scale16, min16);
    const float d = half_to_float(blk.d), dmin = half_to_float(blk.dmin);
    for (int v = 0; v < kSuper; ++v) {
      const float ds = d * static_cast<float>(scale16[v / 16]), dm = dmin * static_cast<float>(min16[v / 16]);
      w[v] = ds * static_cast<float>(q[v]) - dm;
    }
  }
};

template <>
struct KQuant<Q6KBlock> {
  // summ = sum_i sc[i] * xsum_i: the -32 of every quant
  static uint16_t d_bits(const Q6KBlock& blk) { return blk.d; }
  static uint16_t dmin_bits(const Q6KBlock&) { return 0; }
  FF_INLINE static float min_factor(float d, float, float dx) { return -32.f * (d * dx); }  // exact: a power of 2
  FF_INLINE static void decode(const Q6KBlock& blk, int* q, int* scale16, int* min16) {
    for (int v = 0; v < kSuper; ++v) {
      const int half = v / 128, k = (v % 128) / 32, l = v % 32;
      const uint8_t low = blk.ql[64 * half + 32 * (k % 2) + l];
      q[v] = (k < 2 ? low & 15 : low >> 4) | (((blk.qh[32 * half + l] >> (2 * k)) & 3) << 4);
    }
    for (int i = 0; i < 16; ++i) scale16[i] = blk.scales[i], min16[i] = blk.scales[i];
  }
  FF_INLINE static void dequantize(const Q6KBlock& blk, float* w) {
    int q[kSuper], scale16[16], min16[16];
    decode(blk, q, scale16, min16);
    const float d = half_to_float(blk.d);
    for (int v = 0; v < kSuper; ++v) {
      w[v] = (d * static_cast<float>(scale16[v / 16])) * static_cast<float>(q[v] - 32);  // gguf: (d * sc) * (q - 32)
    }
  }
};

// ---- scalar kernels (any CPU; the reference) ----

void quantize_super_scalar(const float* x, int8_t* q, float* d, int16_t* sums) {
  float amax = 0.f;
  for (int v = 0; v < kSuper; ++v) amax = std::max(amax, std::fabs(x[v]));
  const float inverse = amax != 0.f ? 127.f / amax : 0.f;
  for (int i = 0; i < 16; ++i) {
    int sum = 0;
    for (int v = 16 * i; v < 16 * i + 16; ++v) {
      const int value = static_cast<int>(std::nearbyint(x[v] * inverse));  // half to even, as AVX2's round
      q[v] = static_cast<int8_t>(value);
      sum += value;
    }
    sums[i] = static_cast<int16_t>(sum);
  }
  *d = amax / 127.f;
}

// One weight row (nb blocks) against x rows m0 .. m0 + tile - 1: out[t * ld] (+ bias[0]).
// A block's two integers are whole (exact: every kernel forms them in its own order), then one
// float multiply-add each, in block order; the two sums are added at the end.
template <class Block>
void kquant_int8act_scalar(int tile, const Block* row, int64_t nb, const SuperRows& x, int64_t m0, const Output& o) {
  float acc[kScalarTile] = {}, acc_min[kScalarTile] = {};
  for (int64_t b = 0; b < nb; ++b) {
    int q[kSuper], scale16[16], min16[16];
    KQuant<Block>::decode(row[b], q, scale16, min16);
    const float d = half_to_float(KQuant<Block>::d_bits(row[b])), dmin = half_to_float(KQuant<Block>::dmin_bits(row[b]));
    for (int t = 0; t < tile; ++t) {
      const int64_t xb = (m0 + t) * nb + b;
      const int8_t* xq = x.quants(xb);
      const int16_t* sums = x.sums16(xb);
      const float dx = x.d[xb];
      int32_t sumi = 0, summ = 0;
      for (int i = 0; i < 16; ++i) {
        int32_t dot = 0;
        for (int v = 16 * i; v < 16 * i + 16; ++v) dot += q[v] * xq[v];
        sumi += scale16[i] * dot;
        summ += min16[i] * sums[i];
      }
      acc[t] = std::fma(d * dx, static_cast<float>(sumi), acc[t]);
      acc_min[t] = std::fma(KQuant<Block>::min_factor(d, dmin, dx), static_cast<float>(summ), acc_min[t]);
    }
  }
  for (int t = 0; t < tile; ++t) {
    const float sum = acc[t] + acc_min[t];
    o.out[t * o.ld] = o.bias ? sum + o.bias[0] : sum;
  }
}

template <class Block>
void kquant_f32act_scalar(int tile, const Block* row, int64_t nb, const FloatX& x, int64_t m0, const Output& o) {
  float acc[kScalarTile][8] = {};
  for (int64_t b = 0; b < nb; ++b) {
    float w[kSuper];
    KQuant<Block>::dequantize(row[b], w);
    for (int t = 0; t < tile; ++t) {
      const float* xb = x.x + (m0 + t) * x.ld + b * kSuper;
      for (int v = 0; v < kSuper; ++v) acc[t][v % 8] = std::fma(xb[v], w[v], acc[t][v % 8]);
    }
  }
  for (int t = 0; t < tile; ++t) {
    const float sum = hsum8_scalar(acc[t]);
    o.out[t * o.ld] = o.bias ? sum + o.bias[0] : sum;
  }
}

// ---- x86 kernels: kquants_x86.inc and kquants_panel_x86.inc, twice ----
#if FF_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define FF_VNNI 0
#include "kquants_x86.inc"
#include "kquants_panel_x86.inc"
#undef FF_VNNI
}  // namespace avx2
#pragma GCC pop_options

#endif  // FF_X86

#if FF_BUILDS_VNNI
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
namespace vnni {
#define FF_VNNI 1
#include "kquants_x86.inc"
#include "kquants_panel_x86.inc"
#undef FF_VNNI
}  // namespace vnni
#pragma GCC pop_options
#elif FF_X86
namespace vnni {  // not built (FF_WIDEST_ISA): AVX2's names
using namespace avx2;
}  // namespace vnni
#endif

#if FF_BUILDS_AMX
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")
namespace amx {
#include "kquants_amx.inc"
}  // namespace amx
#pragma GCC pop_options
#elif FF_X86
namespace amx {  // not built (FF_WIDEST_ISA)
constexpr int64_t kAmxRows = 16;
template <class... Args>
void amx_units(Args&&...) { __builtin_trap(); }
inline void quantize_amx(const float*, int64_t, int64_t, AmxRows&) { __builtin_trap(); }
}  // namespace amx
#endif

// ---- drivers ----

#if FF_X86
// The panel kernels' chunk of weight rows, and its scratch memory's type.
template <class Block, class PanelBlockT>
void panel_units(void (*chunk)(const Block*, int64_t, int64_t, int64_t, const SuperRows&, int64_t, const OutputMatrix&,
                               PanelBlockT*),
                 int64_t panel_rows, const Block* weights, int64_t nb, int64_t n, int64_t rows, const SuperRows& xa,
                 const OutputMatrix& result, int64_t first, int64_t last) {
  std::vector<PanelBlockT> panel(nb);
  for (int64_t c = first; c < last; ++c) {
    chunk(weights, nb, c * panel_rows, std::min(panel_rows, n - c * panel_rows), xa, rows, result, panel.data());
  }
}
#endif

// Units: with int8 activations and x rows in the hundreds (a prompt), a panel of kPanelRows weight
// rows; otherwise a chunk of kChunkRows weight rows, whose x tiles stay in L1 while it passes.
int64_t kquant_unit_rows(int64_t rows, bool int8_activations, int isa) {
#if FF_X86
  if (int8_activations && isa != kScalar && rows >= kquant_panel_min_rows(isa)) {
    return isa == kAmx ? amx::kAmxRows : isa == kVnni ? vnni::kPanelRows : avx2::kPanelRows;
  }
#endif
  (void)rows, (void)int8_activations, (void)isa;
  return kChunkRows;
}

template <class Block>
void kquant_run_block(const PackedMatrix& packed, const ProductX& x, const OutputMatrix& result, bool int8_activations,
                      int isa, int64_t first, int64_t last) {
  const Block* weights = static_cast<const Block*>(packed.data);
  const int64_t nb = packed.nb, n = packed.n, rows = x.rows;
  const SuperRows& xa = x.blocks256;
  const FloatX xf{x.x, x.k};
#if FF_X86
  if (int8_activations && isa == kAmx && rows >= kquant_panel_min_rows(isa)) {
    note_ran(kKQuantProducts, kAmx);
    amx::amx_units(weights, nb, n, x.amx256, rows, result, first, last);
    return;
  }
#endif
  isa = vector_isa(isa);
  note_ran(kKQuantProducts, isa);
#if FF_X86
  if (int8_activations && isa != kScalar && rows >= kquant_panel_min_rows(isa)) {
    if (isa == kVnni) {
      panel_units(vnni::panel_chunk<Block>, vnni::kPanelRows, weights, nb, n, rows, xa, result, first, last);
    } else {
      panel_units(avx2::panel_chunk<Block>, avx2::kPanelRows, weights, nb, n, rows, xa, result, first, last);
    }
    return;
  }
#endif
  int64_t tile_rows = kScalarTile;
#if FF_X86
  if (isa != kScalar) tile_rows = int8_activations ? avx2::kKInt8Tile : avx2::kKFloatTile;
#endif
  // one weight row against x rows [m0, m0 + tile)
  auto row_tile = [&](int64_t r, int64_t m0, int tile) {
    const Block* row = weights + r * nb;
    const Output o = result.part(m0, r, 1);
#if FF_X86
    if (isa != kScalar) {
      if (int8_activations) {
        // one x row: AVX2's kernel on either (the same bits); VNNI's, compiled for AVX-512, ran
        // Q6_K's at half the speed (4096 x 4096, M = 1, one thread: 1.33 ms against 0.75)
        const bool wide = isa == kVnni && tile > 1;
        (wide ? vnni::kquant_int8act_rows<Block> : avx2::kquant_int8act_rows<Block>)(tile, row, nb, xa, m0, o);
      } else {
        (isa == kVnni ? vnni::kquant_f32act_rows<Block> : avx2::kquant_f32act_rows<Block>)(tile, row, nb, xf, m0, o);
      }
      return;
    }
#endif
    if (int8_activations) {
      kquant_int8act_scalar<Block>(tile, row, nb, xa, m0, o);
    } else {
      kquant_f32act_scalar<Block>(tile, row, nb, xf, m0, o);
    }
  };
  for (int64_t c = first; c < last; ++c) {
    const int64_t r1 = std::min(n, (c + 1) * kChunkRows);
    int64_t r0 = c * kChunkRows;
#if FF_X86
    // 8 weight rows at a time against tiles of x rows (kquants_x86.inc, "a weight row's block,
    // made ready once for the x rows of a tile")
    const bool eights = int8_activations && isa != kScalar;
    for (; eights && r0 + 8 <= r1; r0 += 8) {
      const Block* eight[8];
      for (int i = 0; i < 8; ++i) eight[i] = weights + (r0 + i) * nb;
      for (int64_t m0 = 0; m0 < rows; m0 += kRows8Tile) {
        const int tile = static_cast<int>(std::min<int64_t>(kRows8Tile, rows - m0));
        if (isa == kVnni) {
          vnni::kquant_int8act_rows8(tile, eight, nb, xa, m0, result.part(m0, r0, 8));
        } else {
          avx2::kquant_int8act_rows8(tile, eight, nb, xa, m0, result.part(m0, r0, 8));
        }
      }
    }
#endif
    for (int64_t m0 = 0; m0 < rows; m0 += tile_rows) {
      const int tile = static_cast<int>(std::min(tile_rows, rows - m0));
      for (int64_t r = r0; r < r1; ++r) row_tile(r, m0, tile);
    }
  }
}

}  // namespace

namespace flashformer_cpu {

void quantize_blocks256(const float* x, int64_t first, int64_t last, SuperRows& out) {
  const int isa = use_isa().load();
  note_ran(kQuantizingX, isa == kScalar ? kScalar : kAvx2);
  for (int64_t i = first; i < last; ++i) {
#if FF_X86
    if (isa != kScalar) {  // the same instructions on either: the AVX2 build serves both
      avx2::quantize_super(x + i * kSuper, out.q + i * kSuper, &out.d[i], out.sums + i * 16);
      continue;
    }
#endif
    quantize_super_scalar(x + i * kSuper, out.q + i * kSuper, &out.d[i], out.sums + i * 16);
  }
  (void)isa;
}

void quantize_blocks256_amx(const float* x, int64_t first, int64_t last, AmxRows& out) {
#if FF_X86
  note_ran(kQuantizingX, kAmx);
  amx::quantize_amx(x, first, last, out);
#else
  (void)x, (void)first, (void)last, (void)out;
  TORCH_CHECK(false, "AMX tiles on a CPU that is not x86");
#endif
}

int64_t kquant_units(const PackedMatrix& w, int64_t rows, bool int8_activations, int isa) {
  const int64_t unit_rows = kquant_unit_rows(rows, int8_activations, isa);
  return (w.n + unit_rows - 1) / unit_rows;
}

template <Packing kPacking>
void kquant_run(const PackedMatrix& w, const ProductX& x, const OutputMatrix& out, bool int8_activations, int isa,
                int64_t first, int64_t last) {
  kquant_run_block<KQuantBlock<kPacking>>(w, x, out, int8_activations, isa, first, last);
}
template void kquant_run<kQ4K>(const PackedMatrix&, const ProductX&, const OutputMatrix&, bool, int, int64_t, int64_t);
template void kquant_run<kQ5K>(const PackedMatrix&, const ProductX&, const OutputMatrix&, bool, int, int64_t, int64_t);
template void kquant_run<kQ6K>(const PackedMatrix&, const ProductX&, const OutputMatrix&, bool, int, int64_t, int64_t);

template <Packing kPacking>
void kquant_dequantize_row(const PackedMatrix& w, int64_t row, float* out) {
  using Block = KQuantBlock<kPacking>;
  const Block* blocks = static_cast<const Block*>(w.data) + row * w.nb;
  for (int64_t b = 0; b < w.nb; ++b) KQuant<Block>::dequantize(blocks[b], out + b * kSuper);
}
template void kquant_dequantize_row<kQ4K>(const PackedMatrix&, int64_t, float*);
template void kquant_dequantize_row<kQ5K>(const PackedMatrix&, int64_t, float*);
template void kquant_dequantize_row<kQ6K>(const PackedMatrix&, int64_t, float*);

}  // namespace flashformer_cpu
