// The most int8 multiply-adds one core makes with AVX2 and no VNNI: vpmaddubsw (32 unsigned x
// signed byte products, summed in pairs) then vpmaddwd by ones (the widening every int8 product
// on AVX2 needs) and vpaddd, in 8 independent chains (gcc -O2 keeps some of the sums on the stack:
// their loads and stores use other ports than the two the products share). The ceiling the AVX2
// prompt rows of docs/benchmarks.md ("The native decoder") are measured against.
//
//     g++ -O2 -mavx2 -o /tmp/avx2_int8_peak scripts/avx2_int8_peak.cpp && /tmp/avx2_int8_peak
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

// one chain's step; the empty asm makes its operand opaque, so nothing is hoisted out of the loop
#define CHAIN(i)                     \
  asm volatile("" : "+x"(a##i)); \
  c##i = _mm256_add_epi32(c##i, _mm256_madd_epi16(_mm256_maddubs_epi16(a##i, b), ones));

int main() {
  const __m256i b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  __m256i a0 = _mm256_set1_epi8(3), a1 = _mm256_set1_epi8(4), a2 = _mm256_set1_epi8(5), a3 = _mm256_set1_epi8(6);
  __m256i a4 = _mm256_set1_epi8(7), a5 = _mm256_set1_epi8(8), a6 = _mm256_set1_epi8(9), a7 = _mm256_set1_epi8(10);
  __m256i c0 = a0, c1 = a1, c2 = a2, c3 = a3, c4 = a4, c5 = a5, c6 = a6, c7 = a7;
  const long iters = 50000000;
  double best = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long n = 0; n < iters; ++n) {
      CHAIN(0) CHAIN(1) CHAIN(2) CHAIN(3) CHAIN(4) CHAIN(5) CHAIN(6) CHAIN(7)
    }
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3)),
                                     _mm256_add_epi32(_mm256_add_epi32(c4, c5), _mm256_add_epi32(c6, c7)));
  const double macs = 8.0 * iters * 32;
  std::printf("%.1f G int8 multiply-adds/s = %.1f GOP/s on one core (checksum %d)\n", macs / best / 1e9,
              2 * macs / best / 1e9, _mm256_extract_epi32(s, 0));
}
