// Float32 products for the native decoder (decoder_cpu.cpp): out = x @ W^T (+ bias), W float32
// (n, k) row-major, as a float model's nn.Linear holds it. The units of products.h: chunks of
// kChunkRows weight rows against every x row.
//
// Why its own kernel and not MKL's GEMM: a row's result must not depend on its batch (a served
// sequence gets the same tokens alone or among others, and a token of a prompt chunk the same bits
// as in a decode step), and MKL picks its blocking, and so its order of additions, by the shape.
// Here every (x row, weight row) pair takes the same operations in the same order whatever the
// batch: 8 lanes of fused multiply-adds over k's whole eights (lane l: inputs l, l + 8, ...), their
// sum in hsum8_scalar's order, then the last k % 8 inputs one by one, then the bias. The scalar
// kernel performs the same operations (std::fma), so every ISA gives the same bits.
//
// A decode step's products stream W once (memory-bound): one x row against 4 weight rows at a
// time. A prompt's tile of 4 x rows against 2 weight rows keeps 8 accumulators in registers.

#include "products.h"

namespace {

using namespace flashformer_cpu;

constexpr int64_t kChunkRows = 16;  // weight rows a unit passes over every x row with

// One (x row, weight row) pair's dot product, the reference order (see the top of the file).
float dot_scalar(const float* x, const float* w, int64_t k) {
  const int64_t whole = k - k % 8;
  float lanes[8] = {};
  for (int64_t j = 0; j < whole; j += 8) {
    for (int l = 0; l < 8; ++l) lanes[l] = std::fma(x[j + l], w[j + l], lanes[l]);
  }
  float sum = hsum8_scalar(lanes);
  for (int64_t j = whole; j < k; ++j) sum = std::fma(x[j], w[j], sum);
  return sum;
}

void chunk_scalar(const PackedMatrix& w, const ProductX& x, const OutputMatrix& result, int64_t r0, int64_t r1) {
  const float* weights = static_cast<const float*>(w.data);
  for (int64_t m = 0; m < x.rows; ++m) {
    for (int64_t r = r0; r < r1; ++r) {
      const float sum = dot_scalar(x.x + m * x.k, weights + r * w.k, w.k);
      result.out[m * result.ld + r] = result.bias ? sum + result.bias[r] : sum;
    }
  }
}

#if FF_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {

inline float hsum8(__m256 v) {  // in the order of hsum8_scalar
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// x rows m0 .. m0 + T - 1 against weight rows r0 .. r0 + R - 1.
template <int T, int R>
__attribute__((always_inline)) inline void tile(const float* weights, int64_t k, const ProductX& x, int64_t m0,
                                                int64_t r0, const OutputMatrix& result) {
  const int64_t whole = k - k % 8;
  __m256 acc[T][R];
  for (int t = 0; t < T; ++t) {
    for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
  }
  const float* xr[T];
  const float* wr[R];
  for (int t = 0; t < T; ++t) xr[t] = x.x + (m0 + t) * x.k;
  for (int r = 0; r < R; ++r) wr[r] = weights + (r0 + r) * k;
  for (int64_t j = 0; j < whole; j += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(wr[r] + j);
    for (int t = 0; t < T; ++t) {
      const __m256 xv = _mm256_loadu_ps(xr[t] + j);
      for (int r = 0; r < R; ++r) acc[t][r] = _mm256_fmadd_ps(xv, wv[r], acc[t][r]);
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int r = 0; r < R; ++r) {
      float sum = hsum8(acc[t][r]);
      for (int64_t j = whole; j < k; ++j) sum = std::fma(xr[t][j], wr[r][j], sum);
      const int64_t row = r0 + r;
      result.out[(m0 + t) * result.ld + row] = result.bias ? sum + result.bias[row] : sum;
    }
  }
}

template <int T>
void rows_tile(const float* weights, int64_t k, const ProductX& x, int64_t m0, int64_t r0, int64_t r1,
               const OutputMatrix& result) {
  constexpr int R = T == 1 ? 4 : 2;
  int64_t r = r0;
  for (; r + R <= r1; r += R) tile<T, R>(weights, k, x, m0, r, result);
  for (; r < r1; ++r) tile<T, 1>(weights, k, x, m0, r, result);
}

void chunk(const PackedMatrix& w, const ProductX& x, const OutputMatrix& result, int64_t r0, int64_t r1) {
  const float* weights = static_cast<const float*>(w.data);
  int64_t m0 = 0;
  for (; m0 + 4 <= x.rows; m0 += 4) rows_tile<4>(weights, w.k, x, m0, r0, r1, result);
  switch (x.rows - m0) {
    case 3:
      return rows_tile<3>(weights, w.k, x, m0, r0, r1, result);
    case 2:
      return rows_tile<2>(weights, w.k, x, m0, r0, r1, result);
    case 1:
      return rows_tile<1>(weights, w.k, x, m0, r0, r1, result);
  }  // 0 rows left: done
}

}  // namespace avx2
#pragma GCC pop_options
#endif  // FF_X86

}  // namespace

namespace flashformer_cpu {

int64_t float_units(const PackedMatrix& w, int64_t rows, bool int8_activations, int isa) {
  (void)rows, (void)int8_activations, (void)isa;  // x stays float32 whatever int8_activations asks
  return (w.n + kChunkRows - 1) / kChunkRows;
}

void float_run(const PackedMatrix& w, const ProductX& x, const OutputMatrix& out, bool int8_activations, int isa,
               int64_t first, int64_t last) {
  (void)int8_activations;
  note_ran(kFloatProducts, isa == kScalar ? kScalar : kAvx2);  // AVX2's kernel serves every vector ISA
  for (int64_t c = first; c < last; ++c) {
    const int64_t r0 = c * kChunkRows, r1 = std::min(w.n, r0 + kChunkRows);
#if FF_X86
    if (isa != kScalar) {
      avx2::chunk(w, x, out, r0, r1);
      continue;
    }
#endif
    chunk_scalar(w, x, out, r0, r1);
  }
  (void)isa;
}

void float_dequantize_row(const PackedMatrix& w, int64_t row, float* out) {
  const float* source = static_cast<const float*>(w.data) + row * w.k;
  std::copy(source, source + w.k, out);
}

}  // namespace flashformer_cpu
