// The packings, one row each: how a layer holds its weight and which kernels multiply by it, as
// ggml's type_traits_cpu is one table of block types. Everything that depends on the packing reads
// its row: the size of its data (the decoder checks what Python hands it), the form of x its
// kernels read, its units of work, its product and its rows' dequantization. Nothing switches on a
// packing, so no packing can fall through to another's kernels; a new block type (IQ4_XS, as
// MXFP4 did) is a Packing, a row here and its kernels.
//
// Python reads the table (the packings operator: native_decoder.packings()) rather than copying
// its numbers, and tests/kernels/test_kernels_tables.py holds each row to kernels/layouts.py's
// layout and block_types.py's GGUF type of the same name.

#pragma once

#include <iterator>

#include "products.h"

namespace flashformer_cpu {

struct PackingTraits {
  Packing packing;  // its index in kPackings
  const char* name;  // native_decoder's name for it
  const char* layout;  // the Python layout it holds (layouts.LAYOUTS); "" for float32, which has none
  int64_t group_rows;  // output rows a group interleaves (1: rows as they are)
  int64_t block_values;  // inputs a block holds (float32: 1)
  int64_t group_block_bytes;  // bytes of one group's block: the data of (groups, nb) is groups * nb of them
  bool scales;  // whether it keeps its scales beside the data (the K-quants' blocks hold their own)
  XForm float_x;  // the form of x its kernels read with float activations
  XForm int8_x;  // with int8 activations
  XForm amx_x;  // with int8 activations on AMX, from kquant_panel_min_rows(kAmx) x rows
  UnitsKernel units;
  RunKernel run;
  RowKernel dequantize_row;
};

inline constexpr PackingTraits kPackings[] = {
    {kFloat32, "float32", "", 1, 1, 4, false, kXFloat, kXFloat, kXFloat, float_units, float_run,
     float_dequantize_row},
    {kInt4, "int4", "int4", kNibbleGroupRows, kBlock, kNibbleGroupRows * kBlock / 2, true, kXSums32, kXBlocks32,
     kXBlocks32, nibble_units, nibble_run<kInt4>, nibble_dequantize_row<kInt4>},
    {kInt5, "int5", "int5", kNibbleGroupRows, kBlock, kInt5BlockBytes, true, kXSums32, kXBlocks32, kXBlocks32,
     nibble_units, nibble_run<kInt5>, nibble_dequantize_row<kInt5>},
    {kInt8PerBlock, "int8_per_block", "int8", kInt8GroupRows, kBlock, kInt8GroupRows * kBlock, true, kXFloat,
     kXBlocks32, kXBlocks32, int8_units, int8_run<kInt8PerBlock>, int8_dequantize_row<kInt8PerBlock>},
    {kInt8PerRow, "int8_per_row", "int8", kInt8GroupRows, kBlock, kInt8GroupRows * kBlock, true, kXFloat,
     kXBlocks32, kXBlocks32, int8_units, int8_run<kInt8PerRow>, int8_dequantize_row<kInt8PerRow>},
    {kQ4K, "q4_k", "q4_k", 1, kSuper, 144, false, kXFloat, kXBlocks256, kXAmx256, kquant_units, kquant_run<kQ4K>,
     kquant_dequantize_row<kQ4K>},
    {kQ5K, "q5_k", "q5_k", 1, kSuper, 176, false, kXFloat, kXBlocks256, kXAmx256, kquant_units, kquant_run<kQ5K>,
     kquant_dequantize_row<kQ5K>},
    {kQ6K, "q6_k", "q6_k", 1, kSuper, 210, false, kXFloat, kXBlocks256, kXAmx256, kquant_units, kquant_run<kQ6K>,
     kquant_dequantize_row<kQ6K>},
    {kMxfp4, "mxfp4", "mxfp4", 1, kBlock, 17, false, kXFloat, kXBlocks32, kXBlocks32, mxfp4_units, mxfp4_run,
     mxfp4_dequantize_row},
};
inline constexpr int64_t kPackingCount = static_cast<int64_t>(std::size(kPackings));

constexpr bool rows_in_order() {
  for (int64_t i = 0; i < kPackingCount; ++i) {
    if (kPackings[i].packing != i) return false;
  }
  return true;
}
static_assert(rows_in_order(), "kPackings: row i must be Packing i");

inline const PackingTraits& traits(Packing packing) { return kPackings[packing]; }

// The form a product of `rows` x rows on `isa` reads.
inline XForm x_form(Packing packing, bool int8_activations, int64_t rows, int isa) {
  const PackingTraits& t = traits(packing);
  if (!int8_activations) return t.float_x;
  return isa >= kAmx && rows >= kquant_panel_min_rows(isa) ? t.amx_x : t.int8_x;
}

inline int64_t product_units(const PackedMatrix& w, int64_t rows, bool int8_activations, int isa) {
  return traits(w.packing).units(w, rows, int8_activations, isa);
}

inline void product_run(const PackedMatrix& w, const ProductX& x, const OutputMatrix& out, bool int8_activations,
                        int isa, int64_t first, int64_t last) {
  traits(w.packing).run(w, x, out, int8_activations, isa, first, last);
}

inline void dequantize_row(const PackedMatrix& w, int64_t row, float* out) {
  traits(w.packing).dequantize_row(w, row, out);
}

}  // namespace flashformer_cpu
