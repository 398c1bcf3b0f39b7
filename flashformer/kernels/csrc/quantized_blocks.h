// The packed layouts of int4, int5 and int8 as typed block structs (kernels/layouts.py packs them;
// its dequantizers undo them), and the views of a group of rows a kernel reads. Block b of group g
// is entry g * nb + b of qweight and of scales, each viewed as an array of the structs below.
// int4 groups are 8 rows: one sequential stream for the one-row kernel, which reads all 8.
// Inline and in an anonymous namespace: one translation unit (quantized_cpu.cpp) includes it.

#pragma once

#include <type_traits>

#include "packings.h"

namespace {

using namespace flashformer_cpu;

constexpr int64_t kInt4Rows = kNibbleGroupRows;  // int4: output rows interleaved in the packed layout (one group)
constexpr int64_t kGroupRows = kInt8GroupRows;   // int8: the same; int4: half a group, what a float-activation kernel reads

// int4 (GGUF Q4_1): weight = d * q + m, q in 0..15.
struct Int4Block {            // qweight[g, b]: (8, 16) uint8
  uint8_t qs[kInt4Rows][16];  // row r's 32 nibbles: byte j holds q[j] (low) and q[j + 16] (high)
  static constexpr bool kFiveBit = false;
};
// int5 (GGUF Q5_1; Q5_0 with m = -16 d): weight = d * q + m, q in 0..31, int4's nibbles and a
// fifth bit. The fifth bits are rearranged at packing so that a kernel's transposed word i
// (inputs 4i..4i+3 and 16+4i..16+4i+3) finds them with one shift and one mask.
struct Int5Block {            // qweight[g, b]: (160,) uint8
  uint8_t qs[kInt4Rows][16];  // the low 4 bits, as in Int4Block
  uint32_t qh[kInt4Rows];     // row r's fifth bits: byte k, bit i: q[4i + k]'s; bit 4 + i: q[16 + 4i + k]'s
  static constexpr bool kFiveBit = true;
};
template <Packing kPacking>  // kInt4, kInt5
using NibbleBlock = std::conditional_t<kPacking == kInt5, Int5Block, Int4Block>;
struct Int4Scales {       // scales[g, b]: (2, 8) float16 (int4 and int5)
  uint16_t d[kInt4Rows];  // the rows' d, float16 bits
  uint16_t m[kInt4Rows];  // and their m
};

// int8: weight = d * q, d per block (GGUF Q8_0) or per output row.
struct Int8Block {                // qweight[g, b]: (4, 32) int8
  int8_t qs[kGroupRows][kBlock];  // row r's 32 quants
};
struct Int8BlockScales {   // float16 scales[g, b]: (4,)
  uint16_t d[kGroupRows];  // the rows' d, float16 bits
};
struct Int8RowScales {  // float32 scales[4 g .. 4 g + 3]
  float d[kGroupRows];  // the rows' d
};

static_assert(sizeof(Int4Block) == kPackings[kInt4].group_block_bytes &&
                  sizeof(Int5Block) == kPackings[kInt5].group_block_bytes &&
                  sizeof(Int8Block) == kPackings[kInt8PerBlock].group_block_bytes &&
                  sizeof(Int8Block) == kPackings[kInt8PerRow].group_block_bytes && sizeof(Int4Scales) == 32 &&
                  sizeof(Int8BlockScales) == 8 && sizeof(Int8RowScales) == 16,
              "the structs must match the packed tensors (packings.h) byte for byte");

// ---- what a kernel reads and writes ----

// One group of int4 (Block = Int4Block) or int5 (Int5Block) rows. The int8-activation kernels
// read all 8 rows; the float-activation ones 4 of them, first_row .. first_row + 3 (a half
// group: first_row 0 or 4).
template <class Block>
struct NibbleWeights {
  const Block* blocks;       // (nb,)
  const Int4Scales* scales;  // (nb,)
  int64_t nb;
  int64_t first_row;
};

// One group of int8 rows, with per-block scales (kernels with kPerBlock) or per-row ones.
struct Int8Weights {
  const Int8Block* blocks;              // (nb,)
  const Int8BlockScales* block_scales;  // (nb,), or nullptr
  const Int8RowScales* row_scales;      // the group's 4, or nullptr
  int64_t nb;
};

// x (M, K) float32, and (int4) each block's float sum (M, nb), what a block's minimums multiply.
struct FloatRows {
  const float* x;
  int64_t ld;         // K
  const float* sums;  // (M, nb) or nullptr
};

}  // namespace
