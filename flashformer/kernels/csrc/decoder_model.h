// What the native decoder (decoder_cpu.cpp) knows of a model, as load decided it: each layer's
// norms, projections (their parts, each its own packing), attention and feed-forward; the
// embedding, the KV cache's view of each layer and the call's working memory. Plain structs over
// memory the decoder holds (its tensors), in an anonymous namespace: one translation unit
// includes it.

#pragma once

#include <vector>

#include "packings.h"
#include "row_ops.h"

namespace flashformer_cpu {
namespace {

enum NormKind : int { kNoNorm = 0, kRmsNorm = 1, kLayerNorm = 2 };

struct Norm {
  int kind = kNoNorm;
  const float* weight = nullptr;
  const float* bias = nullptr;
  float eps = 0.f;
  int64_t dim = 0;

  void apply(const float* x, float* out) const {
    if (kind == kRmsNorm) return rows::rms_norm(x, weight, eps, dim, out);
    if (kind == kLayerNorm) return rows::layer_norm(x, weight, bias, eps, dim, out);
    if (out != x) std::copy(x, x + dim, out);
  }
};

constexpr size_t kMaxParts = 8;  // weights a projection stacks (a Q4_K_M file's q/k/v: up to 3)

// One weight of a projection, writing output columns column .. column + w.n - 1.
struct Part {
  PackedMatrix w;
  const float* bias;  // added by the kernels; a projection run twice adds its parts' after the sum
  int64_t column;
  bool int8_activations;
};

// x @ W^T (+ bias) for weights stacked along the output (q, k, v; gate and up), each part its own
// packing (a Q4_K_M file's Q6_K v beside Q4_K q and k).
struct Projection {
  std::vector<Part> parts;
  int64_t in = 0, out = 0;
  // int8x2 activations (products.h's int8_residual): x and its rounding error under int8 blocks
  // of residual_block values run as two x rows, their outputs added (the head only)
  bool twice = false;
  int64_t residual_block = 0;

  // The forms of x its parts read for `rows` x rows on `isa`: bit f set for XForm f.
  unsigned forms(int64_t rows, int isa) const {
    unsigned found = 0;
    for (const Part& p : parts) found |= 1u << x_form(p.w.packing, p.int8_activations, rows, isa);
    return found;
  }
};

enum FeedForward : int { kPlain = 0, kGated = 1 };  // down(act(up x)); down(act(gate x) * up x)

struct Layer {
  Norm attn_norm, attn_out_norm, ffn_norm, ffn_out_norm, q_norm, k_norm;
  Projection qkv, out, up, down;  // gated: up's output is gate | up (d_ff columns each)
  int rope = -1;                  // the rotary table of this layer, or none
  float scale = 1.f, softcap = 0.f;
  int64_t window_left = -1;
  int feed_forward = kPlain, activation = rows::kSilu;
};

struct Embedding {
  PackedMatrix table{};
  float scale = 1.f;  // 1: none
  const float* positions = nullptr;  // learned absolute positions (max_positions, d), or none
  int64_t max_positions = 0;
};

// One layer's share of the KV cache, as the pool (Hk, blocks, block_size, D) (a block type's:
// (Hk, blocks, block_size, row bytes)), keys and values each of their own type (kv_blocks.h).
struct CacheView {
  const void* k = nullptr;
  const void* v = nullptr;
  int k_type = 0, v_type = 0;
  int64_t blocks = 0, block_size = 0;
  int64_t k_strides[3] = {0, 0, 0}, v_strides[3] = {0, 0, 0};  // head, block, position
};

// The call's buffers, grown as the largest call asks (never shrunk).
struct Arena {
  std::vector<float> x, h, qkv, attn, o, ff, act, lse, head_in, head_out, rope;
  std::vector<int8_t> q32, q256;
  std::vector<float> d32, s32, d256, sums32;
  std::vector<int32_t> offset32;
  std::vector<int16_t> sums256;
  std::vector<AmxXBlock> amx;
};

}  // namespace
}  // namespace flashformer_cpu
