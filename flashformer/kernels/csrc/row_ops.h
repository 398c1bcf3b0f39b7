// What the native decoder (decoder_cpu.cpp) does to one row between its matrix products: norms,
// RoPE, activations, residual adds, softcaps. Each is written on eight-float vectors (GCC's vector
// extension) once, as an always_inline body (a struct's run), and compiled for the baseline x86-64,
// AVX2 and AVX-512 (quantized_common.h's run_built_for): the ISA use_isa() says runs, as for the
// products. The same operations in the same order in each, never fused (-ffp-contract=off) but
// where fmadd says so, so every build gives the same bits. Reductions (a norm's sums) run in 8
// lanes, added in hsum8_scalar's order, then the tail in order.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "quantized_common.h"

namespace flashformer_cpu {
namespace rows {

#define FF_ROW_INLINE __attribute__((always_inline)) inline

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));

FF_ROW_INLINE f8 load(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
FF_ROW_INLINE void store(float* p, f8 v) { std::memcpy(p, &v, sizeof(v)); }
FF_ROW_INLINE f8 splat(float x) { return f8{} + x; }

// a * b + c rounded once, lane by lane (std::fma): one FMA instruction in the AVX2 and AVX-512
// builds, the C library's exact fmaf in the baseline one, so that every build gives the same bits.
FF_ROW_INLINE f8 fmadd(f8 a, f8 b, f8 c) {
  f8 out;
  for (int l = 0; l < 8; ++l) out[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return out;
}

FF_ROW_INLINE float lane_sum(f8 a) {  // hsum8_scalar's order
  const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  return (s0 + s2) + (s1 + s3);
}

// exp(x) = 2^n e^r given n (nf: an integer near x / ln 2, as a float): r = x - n ln 2 (ln 2 in
// two parts), e^r by its Taylor polynomial to r^7 (|r| <= 0.35: relative error < 1e-8). What
// exp8 below and the attention kernel's softmax weights (paged_attention_cpu.cpp) share.
FF_ROW_INLINE f8 exp_near(f8 x, f8 nf) {
  const i8v n = __builtin_convertvector(nf, i8v);
  const f8 r = (x - nf * 0.693145752f) - nf * 1.42860677e-6f;
  f8 poly = splat(1.f / 5040.f);
  poly = poly * r + 1.f / 720.f;
  poly = poly * r + 1.f / 120.f;
  poly = poly * r + 1.f / 24.f;
  poly = poly * r + 1.f / 6.f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.f;
  poly = poly * r + 1.f;
  f8 two_n;
  const i8v bits = (n + 127) << 23;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return poly * two_n;
}

// exp(x) for any float x: n = round(x / ln 2) by the 1.5 * 2^23 trick. x is clamped to [-87, 88]:
// below, a result < 2e-38 (taken as that); above, float's range ends.
FF_ROW_INLINE f8 exp8(f8 x) {
  x = x < -87.f ? splat(-87.f) : x;
  x = x > 88.f ? splat(88.f) : x;
  const f8 magic = splat(12582912.f);
  return exp_near(x, (x * 1.44269504f + magic) - magic);
}

// tanh(x) = sign(x) (1 - 2 / (e^(2|x|) + 1)); exact to float's rounding but for |x| < 2^-8, where
// the subtraction cancels: there tanh(x) = x - x^3 / 3 (the next term, 2 x^5 / 15, is below
// float's precision).
FF_ROW_INLINE f8 tanh8(f8 x) {
  const f8 a = x < 0.f ? -x : x;
  const f8 large = 1.f - 2.f / (exp8(a + a) + 1.f);
  const f8 small = a - (a * a * a) * (1.f / 3.f);
  const f8 t = a < 0.00390625f ? small : large;
  return x < 0.f ? -t : t;
}

// The activations, as the layers' nn modules define them.
enum Activation : int { kRelu = 0, kGelu = 1, kGeluTanh = 2, kSilu = 3 };

// kind: one of Activation (the decoder checks it when it is set, so no kind falls to another's code).
FF_ROW_INLINE f8 activate8(f8 x, int kind) {
  switch (kind) {
    case kRelu:
      return x > 0.f ? x : f8{};
    case kGeluTanh: {  // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
      const f8 inner = (x + (x * x * x) * 0.044715f) * 0.7978845608f;
      return (x * 0.5f) * (tanh8(inner) + 1.f);
    }
    case kSilu:
      return x / (exp8(-x) + 1.f);
    case kGelu: {  // exact GELU: 0.5 x (1 + erf(x / sqrt 2)), lane by lane
      f8 out;
      for (int l = 0; l < 8; ++l) out[l] = 0.5f * x[l] * (1.f + std::erf(x[l] * 0.70710678118654752f));
      return out;
    }
  }
  __builtin_unreachable();
}

FF_ROW_INLINE float activate1(float x, int kind) {
  f8 v{};
  v[0] = x;
  return activate8(v, kind)[0];
}

// out = act(gate) * up (up nullptr: act(gate)), n values.
struct Activate {
  FF_ROW_INLINE static void run(const float* gate, const float* up, int kind, int64_t n, float* out) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const f8 a = activate8(load(gate + j), kind);
      store(out + j, up ? a * load(up + j) : a);
    }
    for (; j < n; ++j) out[j] = up ? activate1(gate[j], kind) * up[j] : activate1(gate[j], kind);
  }
};
inline void activate(const float* gate, const float* up, int kind, int64_t n, float* out) {
  run_built_for<Activate>(use_isa().load(std::memory_order_relaxed), kRowOperations, gate, up, kind, n, out);
}

// sum of x[j]^2 (RMSNorm) or of x[j] (LayerNorm's mean), in 8 lanes then in order.
FF_ROW_INLINE float sum_of(const float* x, int64_t n, bool squares, float shift) {
  f8 acc{};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const f8 v = load(x + j) - shift;
    acc += squares ? v * v : v;
  }
  float sum = lane_sum(acc);
  for (; j < n; ++j) {
    const float v = x[j] - shift;
    sum += squares ? v * v : v;
  }
  return sum;
}

// RMSNorm: out = (x / sqrt(mean(x^2) + eps)) * w.
struct RmsNorm {
  FF_ROW_INLINE static void run(const float* x, const float* w, float eps, int64_t n, float* out) {
    const float inverse = 1.f / std::sqrt(sum_of(x, n, true, 0.f) / static_cast<float>(n) + eps);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) store(out + j, (load(x + j) * inverse) * load(w + j));
    for (; j < n; ++j) out[j] = (x[j] * inverse) * w[j];
  }
};
inline void rms_norm(const float* x, const float* w, float eps, int64_t n, float* out) {
  run_built_for<RmsNorm>(use_isa().load(std::memory_order_relaxed), kRowOperations, x, w, eps, n, out);
}

// LayerNorm: out = ((x - mean) / sqrt(var + eps)) * w + b, var the mean square deviation.
struct LayerNorm {
  FF_ROW_INLINE static void run(const float* x, const float* w, const float* b, float eps, int64_t n, float* out) {
    const float mean = sum_of(x, n, false, 0.f) / static_cast<float>(n);
    const float inverse = 1.f / std::sqrt(sum_of(x, n, true, mean) / static_cast<float>(n) + eps);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) store(out + j, ((load(x + j) - mean) * inverse) * load(w + j) + load(b + j));
    for (; j < n; ++j) out[j] = ((x[j] - mean) * inverse) * w[j] + b[j];
  }
};
inline void layer_norm(const float* x, const float* w, const float* b, float eps, int64_t n, float* out) {
  run_built_for<LayerNorm>(use_isa().load(std::memory_order_relaxed), kRowOperations, x, w, b, eps, n, out);
}

// x += y.
struct Add {
  FF_ROW_INLINE static void run(float* x, const float* y, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) store(x + j, load(x + j) + load(y + j));
    for (; j < n; ++j) x[j] += y[j];
  }
};
inline void add(float* x, const float* y, int64_t n) {
  run_built_for<Add>(use_isa().load(std::memory_order_relaxed), kRowOperations, x, y, n);
}

// x *= scale (Gemma's embedding scale).
struct Scale {
  FF_ROW_INLINE static void run(float* x, float factor, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) store(x + j, load(x + j) * factor);
    for (; j < n; ++j) x[j] *= factor;
  }
};
inline void scale(float* x, float factor, int64_t n) {
  run_built_for<Scale>(use_isa().load(std::memory_order_relaxed), kRowOperations, x, factor, n);
}

// x = cap * tanh(x / cap) (Gemma 2's final logits).
struct Softcap {
  FF_ROW_INLINE static void run(float* x, float cap, int64_t n) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) store(x + j, tanh8(load(x + j) / cap) * cap);
    for (; j < n; ++j) {
      f8 v{};
      v[0] = x[j] / cap;
      x[j] = tanh8(v)[0] * cap;
    }
  }
};
inline void softcap(float* x, float cap, int64_t n) {
  run_built_for<Softcap>(use_isa().load(std::memory_order_relaxed), kRowOperations, x, cap, n);
}

// RoPE in the rotate-half layout on the first 2 * half channels of one head, in place:
// x[i] = x[i] cos - x[i + half] sin, x[i + half] = x[i + half] cos + x[i] sin.
struct Rotate {
  FF_ROW_INLINE static void run(float* x, const float* cos, const float* sin, int64_t half) {
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
      const f8 a = load(x + i), b = load(x + half + i), c = load(cos + i), s = load(sin + i);
      store(x + i, a * c - b * s);
      store(x + half + i, b * c + a * s);
    }
    for (; i < half; ++i) {
      const float a = x[i], b = x[half + i];
      x[i] = a * cos[i] - b * sin[i];
      x[half + i] = b * cos[i] + a * sin[i];
    }
  }
};
inline void rotate(float* x, const float* cos, const float* sin, int64_t half) {
  run_built_for<Rotate>(use_isa().load(std::memory_order_relaxed), kRowOperations, x, cos, sin, half);
}

}  // namespace rows
}  // namespace flashformer_cpu
