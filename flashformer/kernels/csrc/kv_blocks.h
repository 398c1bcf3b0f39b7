// The KV cache's element types: float32, float16, and llama.cpp's q8_0 and q4_0 blocks (its
// --cache-type-k / --cache-type-v), keys and values each their own. A quantized pool is a uint8
// tensor (..., row_bytes): a head's D values at a position as D / 32 blocks of 32, each a float16
// scale d and then
//   q8_0 (34 bytes): 32 int8 q,         value = q * d,       d = max |x| / 127, q = round(x / d)
//   q4_0 (18 bytes): 16 bytes of nibbles, value = (q - 8) * d, d = x_m / -8 for the x_m of largest
//                    |x|, q = min(15, trunc(x / d + 8.5)); byte j holds element j (low nibble)
//                    and element j + 16 (high nibble)
// which are the reference quantizers of ggml (quantize_row_q8_0_ref, quantize_row_q4_0_ref) as
// gguf-py reproduces them, so a cache block holds the bytes llama.cpp's file format would. Writing
// (decoder_cpu.cpp) quantizes a row as it is computed; attention (paged_attention_cpu.cpp)
// dequantizes a span of 64 keys at a time into its working memory: no float copy of the cache.
// kernels/kv_blocks.py is the Python side (the same rules in torch ops: the tests compare bytes).
//
// Rotation (llama.cpp's since its PR #21038, QuaRot's idea): a block type's error grows with a
// block's largest value, and keys and values have outlier channels. An orthonormal Walsh-Hadamard
// rotation H spreads each outlier over its block before quantizing: keys are stored as H k and
// the queries rotated alike (H q . H k = q . k), values as H v and the attention output rotated
// back (H is its own inverse). Applied where a head's D is a multiple of 64: to keys in blocks of
// the largest power of two dividing D, to values in blocks of 64 (llama.cpp's choices, measured
// there); float types are never rotated.

#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace flashformer_cpu {

enum KvType : int { kKvFloat32 = 0, kKvFloat16 = 1, kKvQ8_0 = 2, kKvQ4_0 = 3 };

constexpr int64_t kKvBlock = 32;  // values per q8_0 / q4_0 block

inline bool kv_quantized(int type) { return type == kKvQ8_0 || type == kKvQ4_0; }

// Each KvType's row (in its order): the values a block holds and the block's bytes (a q8_0 block:
// a float16 scale and 32 int8 quants; q4_0: the scale and 32 nibbles).
struct KvTypeTraits {
  int64_t block_values, block_bytes;
};
inline constexpr KvTypeTraits kKvTypes[] = {{1, 4}, {1, 2}, {kKvBlock, 2 + kKvBlock}, {kKvBlock, 2 + kKvBlock / 2}};

// The bytes of one head's row of `dim` values (dim a multiple of 32 for the block types).
inline int64_t kv_row_bytes(int type, int64_t dim) { return dim / kKvTypes[type].block_values * kKvTypes[type].block_bytes; }

// The bytes of one element of a pool of `type`: offsets into a block pool count bytes.
inline int64_t kv_element_bytes(int type) { return type == kKvFloat32 ? 4 : type == kKvFloat16 ? 2 : 1; }

inline const char* kv_type_name(int type) {
  static const char* names[] = {"float32", "float16", "q8_0", "q4_0"};
  return type >= 0 && type < 4 ? names[type] : "none";
}

// The rotation's block for keys (or values) of `type` and head size `dim`, or 0 for none.
inline int64_t kv_rotation(int type, int64_t dim, bool keys) {
  if (!kv_quantized(type) || dim % 64 != 0) return 0;
  if (!keys) return 64;
  int64_t block = 64;
  while (dim % (2 * block) == 0) block *= 2;
  return block;
}

// x (dim values) rotated in place by the orthonormal Walsh-Hadamard matrix, block by block
// (block a power of two; 0: unchanged): the butterflies a + b, a - b in order of span, then one
// multiply by 1 / sqrt(block) (rounded from double; kv_blocks.py does the same operations).
inline void kv_rotate(float* x, int64_t dim, int64_t block) {
  if (block == 0) return;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(block)));
  for (int64_t start = 0; start < dim; start += block) {
    float* b = x + start;
    for (int64_t span = 1; span < block; span *= 2) {
      for (int64_t i = 0; i < block; i += 2 * span) {
        for (int64_t j = i; j < i + span; ++j) {
          const float low = b[j], high = b[j + span];
          b[j] = low + high, b[j + span] = low - high;
        }
      }
    }
    for (int64_t j = 0; j < block; ++j) b[j] *= scale;
  }
}

// One row of `dim` float32 values into `dst` as `type` (the element offset of a float pool, the
// byte offset of a block pool: dst points at the row). float16 rounds to nearest even, as torch's
// .half(); the block types as the top of this file says.
inline void kv_write_row(int type, const float* x, int64_t dim, void* dst) {
  if (type == kKvFloat32) {
    std::memcpy(dst, x, dim * sizeof(float));
    return;
  }
  if (type == kKvFloat16) {
    uint16_t* out = static_cast<uint16_t*>(dst);
    for (int64_t j = 0; j < dim; ++j) out[j] = c10::detail::fp16_ieee_from_fp32_value(x[j]);
    return;
  }
  uint8_t* out = static_cast<uint8_t*>(dst);
  for (int64_t b = 0; b < dim; b += kKvBlock) {
    const float* xb = x + b;
    float d;
    if (type == kKvQ8_0) {
      float amax = 0.f;
      for (int64_t j = 0; j < kKvBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
      d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      int8_t* q = reinterpret_cast<int8_t*>(out + 2);
      for (int64_t j = 0; j < kKvBlock; ++j) q[j] = static_cast<int8_t>(std::round(xb[j] * id));
    } else {
      float amax = 0.f, max = 0.f;  // the value of largest magnitude (the first of equals)
      for (int64_t j = 0; j < kKvBlock; ++j) {
        if (amax < std::fabs(xb[j])) amax = std::fabs(xb[j]), max = xb[j];
      }
      d = max / -8.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      uint8_t* q = out + 2;
      for (int64_t j = 0; j < kKvBlock / 2; ++j) {
        const int lo = std::min(15, static_cast<int>(xb[j] * id + 8.5f));
        const int hi = std::min(15, static_cast<int>(xb[j + kKvBlock / 2] * id + 8.5f));
        q[j] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
    const uint16_t scale = c10::detail::fp16_ieee_from_fp32_value(d);
    std::memcpy(out, &scale, 2);
    out += kv_row_bytes(type, kKvBlock);
  }
}

// rows x n values of a float16 or block pool (row i at base + at[i], in the pool's elements: bytes
// for a block pool) widened to float32 into dst (row i at dst + i * n). Each value is what the
// type means exactly (float16 widened; q * d, (q - 8) * d one rounding each), so attention over
// such a cache gives the bits it gives over a float32 cache holding these values.
// (paged_attention_cpu.cpp; AVX2 where quantized_common.h's switch allows it, the same bits.)
void kv_widen_rows(int type, const void* base, const int64_t* at, int64_t rows, int64_t n, float* dst);

}  // namespace flashformer_cpu
