// One native-decoder call's inputs (decoder_cpu.cpp's top says what each is), checked before any
// work and read into plain memory, with the attention tasks they make. Every check names the
// argument and what it expected. One translation unit includes it (an anonymous namespace).

#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "attention_tasks.h"
#include "decoder_model.h"
#include "operators_common.h"

namespace flashformer_cpu {
namespace {

// One call's inputs, checked and read into plain memory.
struct Call {
  int64_t T = 0, S = 0, max_blocks = 0;
  std::vector<int64_t> tokens, positions, starts, lengths, tables, slots, logit_rows;
  // the sliding-window layers' own tables and slots (empty: they use tables and slots above)
  int64_t window_max_blocks = 0;
  std::vector<int64_t> window_tables, window_slots;
  const bool* padding = nullptr;
  int64_t padding_len = 0;
  at::Tensor padding_tensor;
  std::vector<Task> tasks;
  float* logits = nullptr;
  std::vector<uint8_t> long_rope;  // per token: its sequence turns by LongRoPE's long table (mark_long_rope)
};

// What a call's checks read of the decoder: its vocabulary, KV heads, the first layer's cache (every
// layer's has its shape) and its learned positions.
struct CallLimits {
  int64_t vocab, kv_heads;
  const CacheView& cache;
  const Embedding& embedding;
};

inline Call check_call(const CallLimits& limits, const at::Tensor& tokens, const at::Tensor& positions,
                       const at::Tensor& q_starts, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                       const at::Tensor& slots, const std::optional<at::Tensor>& key_padding,
                       const at::Tensor& logit_rows) {
  Call c;
  TORCH_CHECK(tokens.dim() == 1 && tokens.numel() > 0, "tokens: expected (T,) with T >= 1, got ", tokens.sizes());
  c.T = tokens.size(0);
  c.tokens = index_values(tokens, "tokens");
  c.positions = index_values(positions, "positions");
  c.slots = index_values(slots, "slots");
  TORCH_CHECK(static_cast<int64_t>(c.positions.size()) == c.T && static_cast<int64_t>(c.slots.size()) == c.T,
              "positions, slots: expected (", c.T, ",) like tokens, got ", positions.sizes(), " and ", slots.sizes());
  TORCH_CHECK(block_tables.dim() == 2, "block_tables: expected (S, max_blocks), got ", block_tables.sizes());
  c.S = block_tables.size(0), c.max_blocks = block_tables.size(1);
  c.tables = index_values(block_tables, "block_tables");
  c.lengths = index_values(seq_lens, "seq_lens");
  c.starts = index_values(q_starts, "q_starts");
  c.logit_rows = index_values(logit_rows, "logit_rows");
  TORCH_CHECK(static_cast<int64_t>(c.lengths.size()) == c.S && static_cast<int64_t>(c.starts.size()) == c.S + 1,
              "seq_lens (S,) and q_starts (S + 1,) must match block_tables' S = ", c.S, ", got ", seq_lens.sizes(),
              " and ", q_starts.sizes());
  TORCH_CHECK(c.starts[0] == 0 && c.starts[c.S] == c.T, "q_starts: expected to run from 0 to T = ", c.T);
  const CacheView& cache = limits.cache;
  for (int64_t s = 0; s < c.S; ++s) {
    const int64_t n = c.starts[s + 1] - c.starts[s];
    TORCH_CHECK(n >= 0 && c.lengths[s] >= n, "q_starts, seq_lens: sequence ", s, " has ", n, " new tokens and ",
                c.lengths[s], " keys");
    const int64_t used = (c.lengths[s] + cache.block_size - 1) / cache.block_size;
    TORCH_CHECK(used <= c.max_blocks, "block_tables: sequence ", s, " holds ", c.lengths[s], " keys, more than ",
                c.max_blocks, " blocks of ", cache.block_size);
    for (int64_t j = 0; j < used; ++j) {
      const int64_t block = c.tables[s * c.max_blocks + j];
      TORCH_CHECK(block >= 0 && block < cache.blocks, "block_tables: block ", block, " of sequence ", s,
                  " is outside the cache's ", cache.blocks);
    }
  }
  for (int64_t t = 0; t < c.T; ++t) {
    TORCH_CHECK(c.tokens[t] >= 0 && c.tokens[t] < limits.vocab, "tokens: id ", c.tokens[t], " is outside the vocabulary of ",
                limits.vocab);
    TORCH_CHECK(c.positions[t] >= 0, "positions: expected >= 0, got ", c.positions[t]);
    TORCH_CHECK(!limits.embedding.positions || c.positions[t] < limits.embedding.max_positions, "positions: ", c.positions[t],
                " is past the ", limits.embedding.max_positions, " learned positions");
    TORCH_CHECK(c.slots[t] >= 0 && c.slots[t] < cache.blocks * cache.block_size, "slots: ", c.slots[t],
                " is outside the cache's ", cache.blocks * cache.block_size, " slots");
  }
  for (int64_t r : c.logit_rows) {
    TORCH_CHECK(r >= 0 && r < c.T, "logit_rows: row ", r, " is not one of the ", c.T, " tokens");
  }
  if (key_padding) {
    TORCH_CHECK(key_padding->dim() == 2 && key_padding->size(0) == c.S && key_padding->scalar_type() == at::kBool,
                "key_padding: expected (S, L) bool for S = ", c.S, ", got ", key_padding->sizes(), " ",
                key_padding->scalar_type());
    c.padding_tensor = key_padding->contiguous();
    c.padding = c.padding_tensor.data_ptr<bool>();
    c.padding_len = key_padding->size(1);
    for (int64_t s = 0; s < c.S; ++s) {
      TORCH_CHECK(c.lengths[s] <= c.padding_len, "key_padding: ", c.padding_len, " keys for a sequence of ",
                  c.lengths[s]);
    }
  }
  c.tasks = attention_tasks(c.S, c.starts.data(), c.lengths.data(), limits.kv_heads, true);
  return c;
}

// The sliding-window layers' block tables (S, window_max_blocks) and slots (T,), checked against their
// pools (`cache`, every windowed layer's shape): they hold only the blocks of each sequence's window
// (serve/paged_cache.py's window group), entries before it point anywhere in the pool (never read).
inline void check_window(Call& c, const CacheView& cache, const at::Tensor& window_tables,
                         const at::Tensor& window_slots) {
  TORCH_CHECK(window_tables.dim() == 2 && window_tables.size(0) == c.S,
              "window_tables: expected (S, max_blocks) with S = ", c.S, ", got ", window_tables.sizes());
  c.window_max_blocks = window_tables.size(1);
  c.window_tables = index_values(window_tables, "window_tables");
  c.window_slots = index_values(window_slots, "window_slots");
  TORCH_CHECK(static_cast<int64_t>(c.window_slots.size()) == c.T, "window_slots: expected (", c.T,
              ",) like tokens, got ", window_slots.sizes());
  for (int64_t s = 0; s < c.S; ++s) {
    const int64_t used = (c.lengths[s] + cache.block_size - 1) / cache.block_size;
    TORCH_CHECK(used <= c.window_max_blocks, "window_tables: sequence ", s, " holds ", c.lengths[s],
                " keys, more than ", c.window_max_blocks, " blocks of ", cache.block_size);
    for (int64_t j = 0; j < used; ++j) {
      const int64_t block = c.window_tables[s * c.window_max_blocks + j];
      TORCH_CHECK(block >= 0 && block < cache.blocks, "window_tables: block ", block, " of sequence ", s,
                  " is outside the sliding-window layers' cache of ", cache.blocks);
    }
  }
  for (int64_t t = 0; t < c.T; ++t) {
    TORCH_CHECK(c.window_slots[t] >= 0 && c.window_slots[t] < cache.blocks * cache.block_size, "window_slots: ",
                c.window_slots[t], " is outside the sliding-window layers' ", cache.blocks * cache.block_size,
                " slots");
  }
}

// LongRoPE's rule, per sequence as transformers applies it per forward pass: a sequence whose last
// position in this call passes the original context (max position + 1 > original) turns every one
// of its new tokens by the long table; the others by the short one. original 0: no long table.
inline void mark_long_rope(Call& c, int64_t original) {
  c.long_rope.assign(c.T, 0);
  for (int64_t s = 0; s < c.S && original > 0; ++s) {
    int64_t last = -1;
    for (int64_t t = c.starts[s]; t < c.starts[s + 1]; ++t) last = std::max(last, c.positions[t]);
    for (int64_t t = c.starts[s]; t < c.starts[s + 1]; ++t) c.long_rope[t] = last + 1 > original;
  }
}

}  // namespace
}  // namespace flashformer_cpu
