// How the native decoder (decoder_cpu.cpp) runs a projection: x in the arena's memory, each row
// prepared in the forms the projection's parts read, and every part's units of work claimed by
// the threads as one list. Inline and in an anonymous namespace: one translation unit includes it.

#pragma once

#include <algorithm>

#include "decoder_model.h"
#include "decoder_threads.h"
#include "packings.h"

namespace flashformer_cpu {
namespace {

// x (rows, k) at `data`, with the arena's memory for its prepared forms.
inline ProductX arena_x(Arena& a, const float* data, int64_t rows, int64_t k) {
  ProductX x;
  x.x = data, x.rows = rows, x.k = k;
  x.blocks32 = {k / kBlock, a.q32.data(), a.d32.data(), a.s32.data(), a.offset32.data()};
  x.blocks256 = {k / kSuper, a.q256.data(), a.d256.data(), a.sums256.data()};
  x.amx256 = {k / kSuper, a.amx.data()};
  x.sums32 = a.sums32.data();
  return x;
}

// Row t of x in each of `forms` (Projection::forms: what its parts read).
inline void prepare_row(unsigned forms, ProductX& x, int64_t t) {
  for (XForm form : {kXBlocks32, kXBlocks256, kXSums32, kXAmx256}) {
    if (!(forms >> form & 1u)) continue;
    const int64_t per_row = x.k / form_block(form);
    prepare_x(form, x, t * per_row, (t + 1) * per_row);
  }
}

// out (rows, ld) = x @ W^T (+ bias): every part's units, claimed by the threads as one list.
inline void project(Worker& w, Phase phase, const Projection& projection, const ProductX& x, float* out,
                    int64_t ld, int isa) {
  int64_t offsets[kMaxParts];
  const size_t parts = projection.parts.size();
  int64_t units = 0;
  for (size_t i = 0; i < parts; ++i) {
    offsets[i] = units;
    const Part& p = projection.parts[i];
    units += product_units(p.w, x.rows, p.int8_activations, isa);
  }
  w.run(phase, units, [&](int64_t first, int64_t last) {
    for (size_t i = 0; i < parts; ++i) {
      const int64_t end = i + 1 < parts ? offsets[i + 1] : units;
      const int64_t lo = std::max(first, offsets[i]), hi = std::min(last, end);
      if (lo >= hi) continue;
      const Part& p = projection.parts[i];
      const OutputMatrix result{out + p.column, p.w.n, projection.twice ? nullptr : p.bias, ld};
      product_run(p.w, x, result, p.int8_activations, isa, lo - offsets[i], hi - offsets[i]);
    }
  });
}

}  // namespace
}  // namespace flashformer_cpu
