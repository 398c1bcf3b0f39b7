// One matrix product out = x @ W^T (+ bias) as units of work that any thread may take, in any order.
//
// The operators of quantized_cpu.cpp and kquants_cpu.cpp hand a product's units to at::parallel_for;
// the native decoder (decoder_cpu.cpp) hands them to the threads of its step. A unit writes its own
// output rows for every x row, and what it computes depends on the packing, the number of x rows and
// the ISA only, never on the thread, the other units or the rows' batch: so the operators and the
// decoder give the same bits, and a row's result is the same alone or among others.
//
// Each packing reads x in one form, prepared before its units run (prepare_x, in ranges too):
//   int4, int5, int8, MXFP4 with int8 activations   x quantized per block of 32 (Int8Rows)
//   Q4_K, Q5_K, Q6_K with int8 activations   x quantized per block of 256 (SuperRows, llama.cpp's Q8_K);
//                                            many rows on AMX: the same, laid out for its tiles (AmxRows)
//   int4, int5 with float activations        x and each block of 32's float sum
//   the rest                                 x as it is

#pragma once

#include "quantized_common.h"

namespace flashformer_cpu {

constexpr int64_t kSuper = 256;  // values per K-quant block (GGUF's QK_K)

// x (M, K) quantized per block of 32: x[m, 32 b + j] ~ d[m, b] * q[m, b, j], q in [-127, 127].
// A view: the caller owns the memory (Int8RowsStorage, or the decoder's arena).
struct Int8Rows {
  int64_t blocks = 0;  // per row
  int8_t* q = nullptr;            // (M, blocks, 32)
  float* d = nullptr;             // (M, blocks)
  float* s = nullptr;             // (M, blocks): d * sum_j q[j], what an int4 block's minimum multiplies
  int32_t* offset = nullptr;      // (M, blocks): -128 * sum_j q[j], VNNI's int8 kernel's starting sum
  const int8_t* quants(int64_t block) const { return q + block * kBlock; }  // (32,)
};

// x (M, K) quantized per block of 256: x[m, 256 b + v] ~ d[m, b] * q[m, b, v], q in [-127, 127].
struct SuperRows {
  int64_t blocks = 0;
  int8_t* q = nullptr;       // (M, blocks, 256)
  float* d = nullptr;        // (M, blocks)
  int16_t* sums = nullptr;   // (M, blocks, 16): each 16 quants' sum
  const int8_t* quants(int64_t block) const { return q + block * kSuper; }
  const int16_t* sums16(int64_t block) const { return sums + block * 16; }
};

// x quantized per block of 256 as SuperRows quantizes it, laid out for AMX's tiles (kquants_amx.inc):
// per tile of 16 x rows and block, the tile's quants as a tile multiplication's second operand (the
// 4 quants of word w of row n at q[w][4 n .. 4 n + 3]), and lane n of the rows' scales and of their
// 16-value sums, two to a 32-bit lane.
struct AmxXBlock {
  int8_t q[64][64];
  float d[16];
  int32_t sums[8][16];
};

struct AmxRows {
  int64_t blocks = 0;  // per row
  AmxXBlock* tiles = nullptr;  // (ceil(M / 16), blocks)
  AmxXBlock& at(int64_t tile, int64_t block) const { return tiles[tile * blocks + block]; }
};

// x rows from which the K-quants' panel kernels run (below: 8 ready weight rows against tiles of
// x rows). The crossover, a 1B-shaped Q4_K_M forward in the native decoder on a Sapphire Rapids
// core pair: AMX's panels from 16 rows (at 16: 145 ms both, at 24: 183 against 230), VNNI's from 32
// (at 24: 255 against 205, at 32: 283 against 276), AVX2's from 24 (at 16: 206 against 179, at 24:
// 272 against 284); docs/benchmarks.md, "K-quant products of a few rows".
inline int64_t kquant_panel_min_rows(int isa) { return isa >= kAmx ? 16 : isa == kVnni ? 32 : 24; }

// How a layer holds its weight (the layouts: kernels/layouts.py). Each is a row of packings.h's
// table, which says everything else about it: its shapes, the form of x it reads, its kernels.
enum Packing : int {
  kFloat32 = 0,      // data float32 (n, k), row-major
  kInt4 = 1,         // data uint8 (groups, nb, 8, 16), scales float16 (groups, nb, 2, 8)
  kInt5 = 2,         // data uint8 (groups, nb, 160), scales as int4's
  kInt8PerBlock = 3, // data int8 (groups, nb, 4, 32), scales float16 (groups, nb, 4)
  kInt8PerRow = 4,   // data int8 (groups, nb, 4, 32), scales float32 (groups * 4,)
  kQ4K = 5,          // data uint8 (n, nb, 144): the file's blocks; no scales
  kQ5K = 6,          // (n, nb, 176)
  kQ6K = 7,          // (n, nb, 210)
  kMxfp4 = 8,        // data uint8 (n, nb, 17): the file's blocks of 32; no scales
};

// The packings' shapes the operators check (the kernels' block structs: quantized_cpu.cpp and
// kquants_cpu.cpp assert that they match).
constexpr int64_t kNibbleGroupRows = 8;   // int4, int5: the output rows a group interleaves
constexpr int64_t kInt8GroupRows = 4;     // int8
constexpr int64_t kInt5BlockBytes = 160;  // int5: a group's block of 32 inputs

// One (n, k) weight: n output rows in `groups` groups (rows interleaved by the packing; float32
// and the K-quants: one row a group), k inputs in nb blocks (float32: k "blocks" of one).
struct PackedMatrix {
  Packing packing;
  const void* data;
  const void* scales;  // or nullptr
  int64_t n, k, groups, nb;
};

// The form of x a packing's kernels read (see the top of the file).
enum XForm : int { kXFloat = 0, kXBlocks32 = 1, kXBlocks256 = 2, kXSums32 = 3, kXAmx256 = 4 };

// What a product reads of x (M, K): the floats, and the prepared form its packing wants.
struct ProductX {
  const float* x = nullptr;
  int64_t rows = 0, k = 0;
  Int8Rows blocks32;
  SuperRows blocks256;
  AmxRows amx256;
  float* sums32 = nullptr;  // (M, K / 32): each block of 32's float sum, added in index order
};

// Preparing x: items first .. last - 1 of the form's (rows * K / block) blocks, on any thread.
void quantize_blocks32(const float* x, int64_t first, int64_t last, Int8Rows& out);
void quantize_blocks256(const float* x, int64_t first, int64_t last, SuperRows& out);
void quantize_blocks256_amx(const float* x, int64_t first, int64_t last, AmxRows& out);
void sum_blocks32(const float* x, int64_t first, int64_t last, float* sums);

inline int64_t form_block(XForm form) { return form == kXBlocks256 || form == kXAmx256 ? kSuper : kBlock; }

// What a layer's x is multiplied as (kernels/quantized.py's ACTIVATIONS, the decoder's add_part):
// float32 as it is, int8 blocks, or int8x2 (below). The kernels see float or int8 only.
enum Activations : int { kFloatActivations = 0, kInt8Activations = 1, kInt8x2Activations = 2 };

// x's rounding error under the int8 blocks of `block` (32: Int8Rows, 256: SuperRows) values, rows
// (rows, k): out = x - d q. The int8x2 activations (kernels/quantized.py) are x ~ d q + d' q': a
// product runs x and this residual as two x rows, each quantized to int8 as any x row, and adds
// the two outputs: ~15 bits of x where int8 keeps 8, for the cost of a second x row, which the
// kernels' tiles multiply by the same weight bytes (a decode step's memory-bound head: no slower).
void int8_residual(const float* x, int64_t rows, int64_t k, int64_t block, float* out);

// Every x block of `form` in one call (x.rows * x.k / block of them).
inline void prepare_x(XForm form, ProductX& x, int64_t first, int64_t last) {
  if (form == kXBlocks32) quantize_blocks32(x.x, first, last, x.blocks32);
  if (form == kXBlocks256) quantize_blocks256(x.x, first, last, x.blocks256);
  if (form == kXAmx256) quantize_blocks256_amx(x.x, first, last, x.amx256);
  if (form == kXSums32) sum_blocks32(x.x, first, last, x.sums32);
}

// Each packing's kernels, the functions its row of packings.h's table points to: the units of a
// product, one range of them (rows: x's rows; isa: use_isa()), and row `row` of the weight as float32
// (k values, as the Python dequantizers compute it: an embedding table's rows). quantized_cpu.cpp
// defines them for int4, int5 and int8 (instantiated for each of their packings), kquants_cpu.cpp
// for the K-quants, mxfp4_cpu.cpp for MXFP4, float_cpu.cpp for float32.
using UnitsKernel = int64_t (*)(const PackedMatrix& w, int64_t rows, bool int8_activations, int isa);
using RunKernel = void (*)(const PackedMatrix& w, const ProductX& x, const OutputMatrix& out, bool int8_activations,
                           int isa, int64_t first, int64_t last);
using RowKernel = void (*)(const PackedMatrix& w, int64_t row, float* out);

int64_t nibble_units(const PackedMatrix& w, int64_t rows, bool int8_activations, int isa);
template <Packing kPacking>  // kInt4, kInt5
void nibble_run(const PackedMatrix& w, const ProductX& x, const OutputMatrix& out, bool int8_activations, int isa,
                int64_t first, int64_t last);
template <Packing kPacking>
void nibble_dequantize_row(const PackedMatrix& w, int64_t row, float* out);
int64_t int8_units(const PackedMatrix& w, int64_t rows, bool int8_activations, int isa);
template <Packing kPacking>  // kInt8PerBlock, kInt8PerRow
void int8_run(const PackedMatrix& w, const ProductX& x, const OutputMatrix& out, bool int8_activations, int isa,
              int64_t first, int64_t last);
template <Packing kPacking>
void int8_dequantize_row(const PackedMatrix& w, int64_t row, float* out);
int64_t kquant_units(const PackedMatrix& w, int64_t rows, bool int8_activations, int isa);
template <Packing kPacking>  // kQ4K, kQ5K, kQ6K
void kquant_run(const PackedMatrix& w, const ProductX& x, const OutputMatrix& out, bool int8_activations, int isa,
                int64_t first, int64_t last);
template <Packing kPacking>
void kquant_dequantize_row(const PackedMatrix& w, int64_t row, float* out);
int64_t mxfp4_units(const PackedMatrix& w, int64_t rows, bool int8_activations, int isa);
void mxfp4_run(const PackedMatrix& w, const ProductX& x, const OutputMatrix& out, bool int8_activations, int isa,
               int64_t first, int64_t last);
void mxfp4_dequantize_row(const PackedMatrix& w, int64_t row, float* out);
int64_t float_units(const PackedMatrix& w, int64_t rows, bool int8_activations, int isa);
void float_run(const PackedMatrix& w, const ProductX& x, const OutputMatrix& out, bool int8_activations, int isa,
               int64_t first, int64_t last);
void float_dequantize_row(const PackedMatrix& w, int64_t row, float* out);

// Units per at::parallel_for task in the operators: at least kTaskBlocks (x row, weight row,
// block of 32) triples of work.
inline int64_t unit_grain(const PackedMatrix& w, int64_t rows, int64_t units) {
  const int64_t blocks32 = std::max<int64_t>(1, w.k / kBlock);
  const int64_t per_unit = std::max<int64_t>(1, rows * blocks32 * ((w.n + units - 1) / std::max<int64_t>(1, units)));
  return std::max<int64_t>(1, kTaskBlocks / per_unit);
}

}  // namespace flashformer_cpu
