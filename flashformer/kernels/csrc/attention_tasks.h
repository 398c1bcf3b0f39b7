// Attention over cached keys as tasks any thread may take (paged_attention_cpu.cpp computes them):
// the operators paged_attention_cpu and attention_cpu hand a call's tasks to at::parallel_for, the
// native decoder (decoder_cpu.cpp) to the threads of its step. A task is one sequence's KV head and
// a slice of its queries; what it computes depends on that sequence alone (batch invariance).

#pragma once

#include <cstdint>
#include <vector>

namespace flashformer_cpu {

// One call's queries, cache and rules. q: token t's query head h at q + t * q_row_stride + h * dim;
// out (T, Hq, Dv) and lse (T, Hq) contiguous. The cache: KV head h's key at position p of a
// sequence whose table lists block j = p / block_size at k + h * k_head_stride + table[j] *
// k_block_stride + (p % block_size) * k_pos_stride, in elements of its type (kv_blocks.h: float32,
// float16, or the bytes of q8_0 / q4_0 blocks).
struct Problem {
  const float* q;
  int64_t q_row_stride;
  const void* k;  // k_type's elements
  const void* v;
  int k_type, v_type;  // kv_blocks.h's KvType
  float* out;
  float* lse;
  int64_t q_heads, kv_heads, dim, dim_v, block_size;
  int64_t k_head_stride, k_block_stride, k_pos_stride;  // elements; the last dim is contiguous
  int64_t v_head_stride, v_block_stride, v_pos_stride;
  float scale, softcap;
  bool causal;
  const float* slopes;  // (B|1, Hq) or nullptr
  int64_t slope_rows;
  const bool* key_padding;  // (B, padding_len) or nullptr
  int64_t padding_len;
  int64_t window_left, window_right;  // -1: unbounded
};

// One task: sequence b's KV head h, its n queries at packed rows q0 .. q0 + n - 1 and key
// positions first_query .. first_query + n - 1, against its first `visible` keys.
struct Task {
  int64_t b, h, first_query, visible, q0, n;
};

// A thread's working memory, reused by its tasks. Row r of a task is query head h * G + r / n's
// query r % n (rows = G x n): (rows,) running max, sum and rescale, (rows, Dv) accumulators,
// (rows, kSpan) scores, then weights, of the span; the span's keys (kSpan, D) and values (kSpan, Dv)
// widened to float32 where the cache holds another type.
struct Scratch {
  std::vector<float> m, l, rescale, acc, s, wide_k, wide_v;
};

// The tasks of S sequences: sequence s's queries are packed rows starts[s] .. starts[s + 1] - 1,
// the last of its lengths[s] keys; causal: each sees the keys up to its own position.
std::vector<Task> attention_tasks(int64_t sequences, const int64_t* starts, const int64_t* lengths, int64_t kv_heads,
                                  bool causal);

// One task; table: its sequence's block table (int64). Writes its rows of p.out and p.lse.
void attend_task(const Problem& p, const Task task, const int64_t* table, Scratch& scratch);

}  // namespace flashformer_cpu
