// The native decoder: a decoder-only Transformer's forward pass over new tokens against a KV cache,
// in one call, on the CPU, with nothing compiled at run time. It is the decode step of `generate`,
// `chat` and the server, their prompt chunks and their batches (kernels/native_decoder.py builds it
// from a model at load; model/native.py says what it reads of each layer).
//
//   tokens, positions (T,)       the new tokens of S sequences, packed one after another
//   q_starts (S + 1,)            sequence s's tokens are rows q_starts[s] .. q_starts[s + 1] - 1
//   seq_lens (S,)                the keys sequence s holds after this call (its new ones the last)
//   block_tables (S, max_blocks) its blocks of the cache, in order; slots (T,) where each new key goes
//   key_padding (S, >= seq_len)  optional: False drops a key (a left-padded batch)
//   window_tables, window_slots  optional: the sliding-window layers' own block tables and slots, when
//                                their pools hold only each sequence's window (the server's window group)
//   logit_rows (R,)              the rows whose logits are returned: (R, vocab) float32
//
// The cache is one pool per layer (Hk, blocks, block_size, D), float32, float16 or q8_0 / q4_0
// blocks (kv_blocks.h; keys and values each their own type), bound once
// (bind_cache): the server's paged pools, or a static cache (B, Hk, max_len, D) seen as B blocks of
// max_len (its transpose(0, 1)).
//
// Why this shape (llama.cpp's hot loop, its graph prebuilt, here written out): eagerly, a decode
// step of a small model is mostly the cost of its Python and its operator calls, each with its own
// fork and join of the threads (SmolLM2-135M: 30 layers, ~15 operators each); torch.compile
// removes that only after minutes of compilation per model, shape and process. Here the layers
// are a fixed program over the model's weights, decided at load: one parallel region per call,
// the threads meeting at a barrier of our own between the steps of a layer (norm, the q/k/v
// product, RoPE and the cache write, attention, ...), each step's work split in units
// (products.h, attention_tasks.h) that threads claim as they come free.
//
// Compiled in bindings_cpu.cpp's unit, with the operators' glue (ATen's headers once).
//
// Bits: every unit, row operation (row_ops.h) and attention task computes what it computes
// whatever the thread, the other rows or the batch: a sequence's tokens are the same alone or among
// others, and the matrix products give the operators' bits (the tests compare both).

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>

#include "attention_tasks.h"
#include "decoder_call.h"
#include "decoder_model.h"
#include "decoder_products.h"
#include "decoder_threads.h"
#include "kv_blocks.h"
#include "packings.h"
#include "row_ops.h"

namespace flashformer_cpu {
namespace {

template <class T>
void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

class NativeDecoder : public torch::CustomClassHolder {
 public:
  NativeDecoder(int64_t d_model, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t vocab_size,
                int64_t n_layers)
      : d_model_(d_model), n_heads_(n_heads), n_kv_heads_(n_kv_heads), head_dim_(head_dim), vocab_(vocab_size),
        layers_(n_layers) {
    TORCH_CHECK(d_model > 0 && n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0 && head_dim > 0 &&
                    vocab_size > 0 && n_layers > 0,
                "NativeDecoder: expected positive sizes with n_heads a multiple of n_kv_heads, got d_model=", d_model,
                " n_heads=", n_heads, " n_kv_heads=", n_kv_heads, " head_dim=", head_dim, " vocab_size=", vocab_size,
                " n_layers=", n_layers);
    caches_.resize(n_layers);
  }

  // ---- building (model/native.py calls these once, at load) ----

  void set_embedding(const at::Tensor& data, const std::optional<at::Tensor>& scales, int64_t packing, int64_t rows,
                     int64_t dim, int64_t groups, int64_t nb, double scale) {
    embedding_.table = packed(data, scales, packing, rows, dim, groups, nb);
    TORCH_CHECK(rows == vocab_ && dim == d_model_, "set_embedding: expected a (", vocab_, ", ", d_model_,
                ") table, got (", rows, ", ", dim, ")");
    embedding_.scale = static_cast<float>(scale);
  }

  void set_positions(const at::Tensor& table) {
    check_floats(table, "positions", -1, d_model_);
    embedding_.positions = hold(table).data_ptr<float>();
    embedding_.max_positions = table.size(0);
  }

  // Rotary table `index` (0: every RoPE layer's, 1: the sliding-window layers' own): its inverse
  // frequencies (rotary_dim / 2,), the same for every layer that reads it.
  void set_rotary(int64_t index, const at::Tensor& inv_freq) {
    TORCH_CHECK(index == 0 || index == 1, "set_rotary: index 0 or 1, got ", index);
    check_floats(inv_freq, "inv_freq", -1, -1);
    TORCH_CHECK(inv_freq.dim() == 1 && 2 * inv_freq.size(0) <= head_dim_, "inv_freq: expected (rotary_dim / 2,) with ",
                "rotary_dim <= head_dim ", head_dim_, ", got ", inv_freq.sizes());
    TORCH_CHECK(rotary_half_ == 0 || rotary_half_ == inv_freq.size(0), "inv_freq: every table has the same length");
    rotary_half_ = inv_freq.size(0);
    inv_freq_[index].assign(inv_freq.data_ptr<float>(), inv_freq.data_ptr<float>() + rotary_half_);
  }

  // Table 0's scaling: the factor on its cos and sin (YaRN's or LongRoPE's attention factor) and
  // LongRoPE's long frequencies past `original` positions (mark_long_rope; original 0: none).
  void set_rotary_scaling(const at::Tensor& long_inv_freq, int64_t original, double cos_sin_factor) {
    TORCH_CHECK(rotary_half_ > 0 && original >= 0, "set_rotary_scaling: set table 0 first; original >= 0, got ",
                original);
    check_floats(long_inv_freq, "long_inv_freq", rotary_half_, -1);
    long_inv_freq_.assign(long_inv_freq.data_ptr<float>(), long_inv_freq.data_ptr<float>() + rotary_half_);
    long_after_ = original, cos_sin_factor_ = static_cast<float>(cos_sin_factor);
  }

  // which: "attn", "attn_out", "ffn", "ffn_out", "q", "k" of a layer, or "final" (layer -1).
  void set_norm(int64_t layer, const std::string& which, int64_t kind, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, double eps) {
    Norm* norm = norm_slot(layer, which);
    const int64_t dim = which == "q" || which == "k" ? head_dim_ : d_model_;
    TORCH_CHECK(kind == kRmsNorm || kind == kLayerNorm, "set_norm: kind 1 (RMSNorm) or 2 (LayerNorm), got ", kind);
    check_floats(weight, "weight", dim, -1);
    norm->kind = static_cast<int>(kind), norm->weight = hold(weight).data_ptr<float>(), norm->dim = dim;
    norm->eps = static_cast<float>(eps);
    if (kind == kLayerNorm) {
      TORCH_CHECK(bias.has_value(), "set_norm: a LayerNorm needs its bias");
      check_floats(*bias, "bias", dim, -1);
      norm->bias = hold(*bias).data_ptr<float>();
    }
  }

  // which: "qkv", "out", "up", "down" of a layer, or "head" (layer -1). A part's rows follow the
  // ones added before it.
  void add_part(int64_t layer, const std::string& which, int64_t packing, const at::Tensor& data,
                const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& bias, int64_t n, int64_t k,
                int64_t groups, int64_t nb, int64_t activations) {
    Projection* projection = projection_slot(layer, which);
    TORCH_CHECK(projection->parts.size() < kMaxParts, "add_part: ", which, " of layer ", layer, " has ",
                kMaxParts, " parts already, the most a projection holds");
    TORCH_CHECK(activations >= kFloatActivations && activations <= kInt8x2Activations,
                "add_part: activations 0 (float32), 1 (int8) or 2 (int8x2), got ", activations);
    const PackedMatrix w = packed(data, scales, packing, n, k, groups, nb);
    const bool twice = activations == kInt8x2Activations, first = projection->parts.empty();
    const int64_t block = form_block(traits(w.packing).int8_x);
    TORCH_CHECK(!twice || (which == "head" && traits(w.packing).int8_x != kXFloat), "add_part: int8x2 activations ",
                "are the head's, on a quantized packing; got ", which, " of layer ", layer, " (", traits(w.packing).name, ")");
    TORCH_CHECK(first || (projection->twice == twice && (!twice || projection->residual_block == block)), "add_part: ",
                which, ": int8x2 activations on every part or none, each reading x in blocks of one size");
    projection->twice = twice, projection->residual_block = block;
    TORCH_CHECK(projection->parts.empty() || projection->in == k, "add_part: ", which, " of layer ", layer,
                " reads ", projection->in, " inputs; this part reads ", k);
    const float* b = nullptr;
    if (bias) {
      check_floats(*bias, "bias", n, -1);
      b = hold(*bias).data_ptr<float>();
    }
    projection->parts.push_back({w, b, projection->out, activations != kFloatActivations});
    projection->in = k;
    projection->out += n;
  }

  void set_attention(int64_t layer, int64_t rope, double scale, double softcap, int64_t window_left) {
    Layer& l = at_layer(layer);
    TORCH_CHECK(rope >= -1 && rope <= 1, "set_attention: rope -1, 0 or 1, got ", rope);
    l.rope = static_cast<int>(rope), l.scale = static_cast<float>(scale), l.softcap = static_cast<float>(softcap);
    l.window_left = window_left;
  }

  void set_feed_forward(int64_t layer, int64_t kind, int64_t activation) {
    Layer& l = at_layer(layer);
    TORCH_CHECK(kind == kPlain || kind == kGated, "set_feed_forward: kind 0 (plain) or 1 (gated), got ", kind);
    TORCH_CHECK(activation >= rows::kRelu && activation <= rows::kSilu, "set_feed_forward: activation 0..3, got ",
                activation);
    l.feed_forward = static_cast<int>(kind), l.activation = static_cast<int>(activation);
  }

  void set_logit_softcap(double cap) { logit_softcap_ = static_cast<float>(cap); }

  // Checks that every layer is whole; after it, the decoder runs.
  void finish() {
    TORCH_CHECK(embedding_.table.data != nullptr, "NativeDecoder: no embedding");
    TORCH_CHECK(head_.out == vocab_ && head_.in == d_model_, "NativeDecoder: the head must map ", d_model_, " to ",
                vocab_, ", got ", head_.in, " to ", head_.out);
    const int64_t q_width = n_heads_ * head_dim_, kv_width = n_kv_heads_ * head_dim_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      TORCH_CHECK(l.attn_norm.kind != kNoNorm && l.ffn_norm.kind != kNoNorm, "layer ", i, ": no pre-norm");
      TORCH_CHECK(l.qkv.in == d_model_ && l.qkv.out == q_width + 2 * kv_width, "layer ", i, ": qkv maps ", l.qkv.in,
                  " to ", l.qkv.out, ", expected ", d_model_, " to ", q_width + 2 * kv_width);
      TORCH_CHECK(l.out.in == q_width && l.out.out == d_model_, "layer ", i, ": out maps ", l.out.in, " to ",
                  l.out.out);
      const int64_t d_ff = l.down.in;
      TORCH_CHECK(l.up.in == d_model_ && l.up.out == (l.feed_forward == kGated ? 2 : 1) * d_ff &&
                      l.down.out == d_model_,
                  "layer ", i, ": the feed-forward's shapes do not fit (up ", l.up.in, " -> ", l.up.out, ", down ",
                  l.down.in, " -> ", l.down.out, ")");
      TORCH_CHECK(l.rope < 0 || !inv_freq_[l.rope].empty(), "layer ", i, ": rotary table ", l.rope, " is not set");
      max_width_ = std::max({max_width_, l.up.out, d_ff});
    }
    TORCH_CHECK(final_norm_.kind != kNoNorm, "NativeDecoder: no final norm");
    ready_ = true;
  }

  // The KV cache: one (Hk, blocks, block_size, D) pool per layer for keys and one for values, each
  // float32, float16 or uint8 rows of q8_0 / q4_0 blocks (Hk, blocks, block_size, row bytes), any
  // strides but a contiguous last dim. The decoder reads and writes them in place.
  void bind_cache(const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size(), "bind_cache: expected ", layers_.size(),
                " key and value pools, got ", k.size(), " and ", v.size());
    held_cache_.clear();
    for (size_t i = 0; i < layers_.size(); ++i) {
      const at::Tensor &kp = k[i], &vp = v[i];
      const bool shaped = kp.dim() == 4 && vp.dim() == 4 && kp.sizes().slice(0, 3) == vp.sizes().slice(0, 3) &&
                          kp.size(0) == n_kv_heads_ && kp.stride(3) == 1 && vp.stride(3) == 1 && kp.device().is_cpu() &&
                          vp.device().is_cpu();
      const int k_type = shaped ? kv_type_of(kp.scalar_type(), kp.size(3), head_dim_) : -1;
      const int v_type = shaped ? kv_type_of(vp.scalar_type(), vp.size(3), head_dim_) : -1;
      TORCH_CHECK(k_type >= 0 && v_type >= 0, "bind_cache: layer ", i, ": expected key and value pools (", n_kv_heads_,
                  ", blocks, block_size, row) with a contiguous last dim, each float32 or float16 rows of ", head_dim_,
                  " or uint8 rows of q8_0 (", kv_row_bytes(kKvQ8_0, head_dim_), " bytes) or q4_0 (",
                  kv_row_bytes(kKvQ4_0, head_dim_), ") blocks (head_dim a multiple of 32), got ", kp.sizes(), " ",
                  kp.scalar_type(), " and ", vp.sizes(), " ", vp.scalar_type());
      CacheView& c = caches_[i];
      c.k = kp.data_ptr(), c.v = vp.data_ptr(), c.k_type = k_type, c.v_type = v_type;
      c.blocks = kp.size(1), c.block_size = kp.size(2);
      for (int j = 0; j < 3; ++j) c.k_strides[j] = kp.stride(j), c.v_strides[j] = vp.stride(j);
      held_cache_.push_back(kp), held_cache_.push_back(vp);
    }
    cache_bound_ = true;
  }

  // ---- running ----

  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& positions, const at::Tensor& q_starts,
                     const at::Tensor& seq_lens, const at::Tensor& block_tables, const at::Tensor& slots,
                     const std::optional<at::Tensor>& key_padding, const at::Tensor& logit_rows,
                     const std::optional<at::Tensor>& window_tables, const std::optional<at::Tensor>& window_slots) {
    TORCH_CHECK(ready_, "NativeDecoder: finish() was not called");
    TORCH_CHECK(cache_bound_, "NativeDecoder: no KV cache bound (bind_cache)");
    TORCH_CHECK(window_tables.has_value() == window_slots.has_value(),
                "window_tables and window_slots: give both or neither");
    // the layers block_tables serve: all of them, or the full-attention ones when windows have their own
    size_t main = 0, windowed = layers_.size();
    for (size_t i = 0; i < layers_.size(); ++i) {
      if (layers_[i].window_left >= 0 && windowed == layers_.size()) windowed = i;
    }
    if (window_tables) {
      while (main < layers_.size() && layers_[main].window_left >= 0) ++main;
      TORCH_CHECK(windowed < layers_.size() && main < layers_.size(),
                  "window_tables: given for a model without both sliding-window and full-attention layers");
    }
    const CallLimits limits{vocab_, n_kv_heads_, caches_[main], embedding_};
    Call call =
        check_call(limits, tokens, positions, q_starts, seq_lens, block_tables, slots, key_padding, logit_rows);
    if (window_tables) check_window(call, caches_[windowed], *window_tables, *window_slots);
    mark_long_rope(call, long_after_);
    at::Tensor logits = at::empty({static_cast<int64_t>(call.logit_rows.size()), vocab_}, at::kFloat);
    call.logits = logits.data_ptr<float>();
    run(call);
    return logits;
  }

  // Profiling (off by default): each kind of step's seconds, summed over the calls since it was
  // switched on; a map of phase name to seconds.
  void set_profiling(bool on) {
    profiling_ = on;
    std::fill(profile_, profile_ + kPhases, 0.0);
  }

  c10::Dict<std::string, double> profile() const {
    c10::Dict<std::string, double> out;
    for (int i = 0; i < kPhases; ++i) out.insert(kPhaseNames[i], profile_[i]);
    return out;
  }

 private:
  void run(Call& c) {
    const int64_t T = c.T, R = static_cast<int64_t>(c.logit_rows.size());
    const int64_t q_width = n_heads_ * head_dim_, qkv_width = q_width + 2 * n_kv_heads_ * head_dim_;
    const int64_t width = std::max({d_model_, q_width, max_width_});
    const int64_t padded = (width + kSuper - 1) / kSuper * kSuper;
    Arena& a = arena_;
    grow(a.x, T * d_model_), grow(a.h, T * d_model_), grow(a.qkv, T * qkv_width), grow(a.attn, T * q_width);
    grow(a.o, T * d_model_), grow(a.ff, T * max_width_), grow(a.act, T * max_width_), grow(a.lse, T * n_heads_);
    const int64_t head_rows = std::max<int64_t>(1, R) * (head_.twice ? 2 : 1);
    grow(a.head_in, head_rows * d_model_), grow(a.rope, 2 * T * 2 * std::max<int64_t>(1, rotary_half_));
    if (head_.twice) grow(a.head_out, head_rows * vocab_);
    const int64_t X = std::max(T, head_rows);  // x rows a product reads
    grow(a.q32, X * padded), grow(a.d32, X * padded / kBlock), grow(a.s32, X * padded / kBlock);
    grow(a.offset32, X * padded / kBlock), grow(a.sums32, X * padded / kBlock);
    grow(a.q256, X * padded), grow(a.d256, X * padded / kSuper), grow(a.sums256, X * padded / 16);
    grow(a.amx, (X + 15) / 16 * (padded / kSuper));

    const int threads = std::max(1, at::get_num_threads());
    const size_t steps = 8 + layers_.size() * 12;  // (11 a layer)
    if (counters_.size() < steps) counters_ = std::vector<Counter>(steps);
    for (Counter& counter : counters_) counter.next.store(0, std::memory_order_relaxed);
    grow(scratch_, threads);
    barrier_.reset(threads);
    const int isa = use_isa().load();
#pragma omp parallel num_threads(threads)
    {
      const int team = omp_get_num_threads();
      if (team != threads) {  // (every thread sees the same team)
        if (omp_get_thread_num() == 0) barrier_.reset(team);
#pragma omp barrier
      }
      Worker w{omp_get_thread_num(), team, &barrier_, counters_.data(), profiling_ ? profile_ : nullptr};
      program(w, c, isa);
    }
  }

  // The program every thread runs: the same steps in the same order.
  void program(Worker& w, const Call& c, int isa) {
    const int64_t T = c.T, d = d_model_;
    Arena& a = arena_;
    Scratch& scratch = scratch_[w.thread];
    // the embeddings and the RoPE tables of this call's positions
    w.each(kEmbed, T, [&](int64_t t) {
      float* x = a.x.data() + t * d;
      dequantize_row(embedding_.table, c.tokens[t], x);
      if (embedding_.scale != 1.f) rows::scale(x, embedding_.scale, d);
      if (embedding_.positions) rows::add(x, embedding_.positions + c.positions[t] * d, d);
      for (int table = 0; table < 2; ++table) {
        if (inv_freq_[table].empty()) continue;
        float* cs = rope_row(table, t, T);
        const bool long_rope = table == 0 && c.long_rope[t];
        const float* freq = long_rope ? long_inv_freq_.data() : inv_freq_[table].data();
        const float factor = table == 0 ? cos_sin_factor_ : 1.f;
        for (int64_t i = 0; i < rotary_half_; ++i) {
          const float angle = static_cast<float>(c.positions[t]) * freq[i];
          cs[i] = static_cast<float>(std::cos(static_cast<double>(angle))) * factor;
          cs[rotary_half_ + i] = static_cast<float>(std::sin(static_cast<double>(angle))) * factor;
        }
      }
    });
    for (size_t i = 0; i < layers_.size(); ++i) layer(w, c, layers_[i], caches_[i], isa, scratch);
    // the rows whose logits are asked: the final norm, the head, the softcap. With int8x2
    // activations the head's x rows are the R normed rows, then their R residuals (int8_residual).
    const int64_t R = static_cast<int64_t>(c.logit_rows.size()), V = vocab_;
    const bool twice = head_.twice;
    ProductX head_x = product_x(a.head_in.data(), twice ? 2 * R : R, d);
    const unsigned head_forms = head_.forms(head_x.rows, isa);
    w.each(kNorm, R, [&](int64_t r) {
      float* row = a.head_in.data() + r * d;
      final_norm_.apply(a.x.data() + c.logit_rows[r] * d, row);
      prepare_row(head_forms, head_x, r);
      if (!twice) return;
      int8_residual(row, 1, d, head_.residual_block, row + R * d);
      prepare_row(head_forms, head_x, R + r);
    });
    project(w, kHead, head_, head_x, twice ? a.head_out.data() : c.logits, V, isa);
    if (!twice && logit_softcap_ <= 0.f) return;
    // spans of a row's logits, shared by the threads: a large vocabulary's sum is no one thread's
    constexpr int64_t kSpan = 8192;
    const int64_t spans = (V + kSpan - 1) / kSpan;
    w.each(kHead, R * spans, [&](int64_t unit) {
      const int64_t r = unit / spans, lo = unit % spans * kSpan, hi = std::min(V, lo + kSpan);
      float* logits = c.logits + r * V;
      if (twice) {  // x's part + the residual's, then the biases
        const float *x_part = a.head_out.data() + r * V, *residual_part = x_part + R * V;
        for (int64_t i = lo; i < hi; ++i) logits[i] = x_part[i] + residual_part[i];
        for (const Part& p : head_.parts) {
          const int64_t first = std::max(lo, p.column), last = std::min(hi, p.column + p.w.n);
          if (p.bias && first < last) rows::add(logits + first, p.bias + (first - p.column), last - first);
        }
      }
      if (logit_softcap_ > 0.f) rows::softcap(logits + lo, logit_softcap_, hi - lo);
    });
  }

  void layer(Worker& w, const Call& c, const Layer& l, const CacheView& cache, int isa, Scratch& scratch) {
    const int64_t T = c.T, d = d_model_, D = head_dim_;
    const int64_t q_width = n_heads_ * D, kv_width = n_kv_heads_ * D, qkv_width = q_width + 2 * kv_width;
    Arena& a = arena_;
    // 1. h = attn_norm(x), made ready for the q/k/v product
    ProductX hx = product_x(a.h.data(), T, d);
    const unsigned qkv_forms = l.qkv.forms(T, isa);
    w.each(kNorm, T, [&](int64_t t) {
      l.attn_norm.apply(a.x.data() + t * d, a.h.data() + t * d);
      prepare_row(qkv_forms, hx, t);
    });
    // 2. q, k, v
    project(w, kQkv, l.qkv, hx, a.qkv.data(), qkv_width, isa);
    // 3. the head norms and RoPE on q and k; a block cache's rotations (kv_blocks.h): q and k
    // rotated alike, v before it is stored; k and v into the cache
    const int64_t k_rotation = kv_rotation(cache.k_type, D, true), v_rotation = kv_rotation(cache.v_type, D, false);
    // a sliding-window layer reads its own tables when the call gives them (check_window)
    const bool own_tables = l.window_left >= 0 && !c.window_tables.empty();
    const int64_t* tables = own_tables ? c.window_tables.data() : c.tables.data();
    const int64_t table_width = own_tables ? c.window_max_blocks : c.max_blocks;
    w.each(kRope, T, [&](int64_t t) {
      float* row = a.qkv.data() + t * qkv_width;
      const float* cs = l.rope >= 0 ? rope_row(l.rope, t, T) : nullptr;
      for (int64_t h = 0; h < n_heads_ + n_kv_heads_; ++h) {
        float* head = row + h * D;
        const Norm& norm = h < n_heads_ ? l.q_norm : l.k_norm;
        if (norm.kind != kNoNorm) norm.apply(head, head);
        if (cs) rows::rotate(head, cs, cs + rotary_half_, rotary_half_);
        kv_rotate(head, D, k_rotation);
      }
      for (int64_t h = 0; h < n_kv_heads_; ++h) kv_rotate(row + q_width + kv_width + h * D, D, v_rotation);
      const int64_t slot = own_tables ? c.window_slots[t] : c.slots[t];
      const int64_t block = slot / cache.block_size, offset = slot % cache.block_size;
      for (int64_t h = 0; h < n_kv_heads_; ++h) {
        write_cache(cache.k, cache.k_type, cache.k_strides, h, block, offset, row + q_width + h * D, D);
        write_cache(cache.v, cache.v_type, cache.v_strides, h, block, offset, row + q_width + kv_width + h * D, D);
      }
    });
    // 4. attention, a task per (sequence, KV head, slice of queries)
    Problem p{};
    p.q = a.qkv.data(), p.q_row_stride = qkv_width;
    p.k = cache.k, p.v = cache.v, p.k_type = cache.k_type, p.v_type = cache.v_type;
    p.out = a.attn.data(), p.lse = a.lse.data();
    p.q_heads = n_heads_, p.kv_heads = n_kv_heads_, p.dim = D, p.dim_v = D, p.block_size = cache.block_size;
    p.k_head_stride = cache.k_strides[0], p.k_block_stride = cache.k_strides[1], p.k_pos_stride = cache.k_strides[2];
    p.v_head_stride = cache.v_strides[0], p.v_block_stride = cache.v_strides[1], p.v_pos_stride = cache.v_strides[2];
    p.scale = l.scale, p.softcap = l.softcap, p.causal = true;
    p.key_padding = c.padding, p.padding_len = c.padding_len;
    p.window_left = l.window_left, p.window_right = -1;
    w.each(kAttention, static_cast<int64_t>(c.tasks.size()), [&](int64_t i) {
      const Task& task = c.tasks[i];
      attend_task(p, task, tables + task.b * table_width, scratch);
    });
    // 5. the output projection
    ProductX attn_x = product_x(a.attn.data(), T, q_width);
    const unsigned out_forms = l.out.forms(T, isa);
    w.each(kPrepare, T, [&](int64_t t) {
      for (int64_t h = 0; h < n_heads_ && v_rotation; ++h) kv_rotate(a.attn.data() + (t * n_heads_ + h) * D, D, v_rotation);
      prepare_row(out_forms, attn_x, t);
    });
    project(w, kOut, l.out, attn_x, a.o.data(), d, isa);
    // 6. x += attn_out_norm(o); h = ffn_norm(x)
    const unsigned up_forms = l.up.forms(T, isa);
    w.each(kResidualNorm, T, [&](int64_t t) {
      float* x = a.x.data() + t * d;
      float* o = a.o.data() + t * d;
      l.attn_out_norm.apply(o, o);
      rows::add(x, o, d);
      l.ffn_norm.apply(x, a.h.data() + t * d);
      prepare_row(up_forms, hx, t);
    });
    // 7. the feed-forward: up (gate | up), act, down
    project(w, kUp, l.up, hx, a.ff.data(), l.up.out, isa);
    const int64_t d_ff = l.down.in;
    ProductX act_x = product_x(a.act.data(), T, d_ff);
    const unsigned down_forms = l.down.forms(T, isa);
    w.each(kAct, T, [&](int64_t t) {
      const float* ff = a.ff.data() + t * l.up.out;
      rows::activate(ff, l.feed_forward == kGated ? ff + d_ff : nullptr, l.activation, d_ff, a.act.data() + t * d_ff);
      prepare_row(down_forms, act_x, t);
    });
    project(w, kDown, l.down, act_x, a.o.data(), d, isa);
    // 8. x += ffn_out_norm(down)
    w.each(kResidual, T, [&](int64_t t) {
      float* o = a.o.data() + t * d;
      l.ffn_out_norm.apply(o, o);
      rows::add(a.x.data() + t * d, o, d);
    });
  }

  ProductX product_x(const float* data, int64_t rows, int64_t k) { return arena_x(arena_, data, rows, k); }

  float* rope_row(int table, int64_t t, int64_t T) {
    return arena_.rope.data() + (static_cast<int64_t>(table) * T + t) * 2 * rotary_half_;
  }

  // One head's D values at (head h, block, offset) of a pool, as its type stores them (kv_blocks.h:
  // float16 rounded to nearest even as torch's .half(), q8_0 / q4_0 quantized as ggml's reference).
  static void write_cache(const void* pool, int type, const int64_t* strides, int64_t h, int64_t block,
                          int64_t offset, const float* values, int64_t dim) {
    const int64_t at = h * strides[0] + block * strides[1] + offset * strides[2];  // the pool's elements
    kv_write_row(type, values, dim, static_cast<char*>(const_cast<void*>(pool)) + at * kv_element_bytes(type));
  }

  // ---- building's helpers ----

  const at::Tensor& hold(const at::Tensor& t) {
    held_.push_back(t);
    return held_.back();
  }

  static void check_floats(const at::Tensor& t, const char* name, int64_t first, int64_t second) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu(), name,
                ": expected a contiguous float32 CPU tensor, got ", t.sizes(), " ", t.scalar_type());
    TORCH_CHECK(first < 0 || t.size(0) == first, name, ": expected ", first, " rows, got ", t.sizes());
    TORCH_CHECK(second < 0 || (t.dim() == 2 && t.size(1) == second), name, ": expected ", second,
                " columns, got ", t.sizes());
  }

  PackedMatrix packed(const at::Tensor& data, const std::optional<at::Tensor>& scales, int64_t packing, int64_t n,
                      int64_t k, int64_t groups, int64_t nb) {
    TORCH_CHECK(packing >= 0 && packing < kPackingCount, "packing: expected 0..", kPackingCount - 1, ", got ",
                packing);
    TORCH_CHECK(data.is_contiguous() && data.device().is_cpu(), "data: expected a contiguous CPU tensor");
    const PackingTraits& kind = traits(static_cast<Packing>(packing));
    if (kind.packing == kFloat32) {
      TORCH_CHECK(data.scalar_type() == at::kFloat && groups == n && nb == k, "float32 data: (n, k) float32");
    }
    const int64_t bytes = groups * nb * kind.group_block_bytes;  // the data's size for this packing and shape
    TORCH_CHECK(data.nbytes() == static_cast<size_t>(bytes), "data: expected ", bytes, " bytes for packing ",
                kind.name, " of (", n, ", ", k, ") in ", groups, " groups of ", nb, " blocks, got ", data.nbytes());
    TORCH_CHECK(kind.scales == scales.has_value(), "scales: packing ", kind.name,
                kind.scales ? " needs its scales" : " has none");
    const void* scale_data = nullptr;
    if (scales) {
      TORCH_CHECK(scales->is_contiguous(), "scales: expected a contiguous tensor");
      scale_data = hold(*scales).data_ptr();
    }
    return {kind.packing, hold(data).data_ptr(), scale_data, n, k, groups, nb};
  }

  Layer& at_layer(int64_t layer) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "layer: expected 0..",
                layers_.size() - 1, ", got ", layer);
    return layers_[layer];
  }

  Norm* norm_slot(int64_t layer, const std::string& which) {
    if (layer == -1 && which == "final") return &final_norm_;
    Layer& l = at_layer(layer);
    if (which == "attn") return &l.attn_norm;
    if (which == "attn_out") return &l.attn_out_norm;
    if (which == "ffn") return &l.ffn_norm;
    if (which == "ffn_out") return &l.ffn_out_norm;
    if (which == "q") return &l.q_norm;
    if (which == "k") return &l.k_norm;
    TORCH_CHECK(false, "set_norm: which is one of attn, attn_out, ffn, ffn_out, q, k (or final), got ", which);
  }

  Projection* projection_slot(int64_t layer, const std::string& which) {
    if (layer == -1 && which == "head") return &head_;
    Layer& l = at_layer(layer);
    if (which == "qkv") return &l.qkv;
    if (which == "out") return &l.out;
    if (which == "up") return &l.up;
    if (which == "down") return &l.down;
    TORCH_CHECK(false, "add_part: which is one of qkv, out, up, down (or head), got ", which);
  }

  int64_t d_model_, n_heads_, n_kv_heads_, head_dim_, vocab_;
  std::vector<Layer> layers_;
  Embedding embedding_;
  Norm final_norm_;
  Projection head_;
  float logit_softcap_ = 0.f;
  std::vector<float> inv_freq_[2], long_inv_freq_;
  int64_t long_after_ = 0;  // LongRoPE's original context (0: no long table)
  float cos_sin_factor_ = 1.f;
  int64_t rotary_half_ = 0;
  int64_t max_width_ = 0;
  bool ready_ = false, cache_bound_ = false;
  std::vector<CacheView> caches_;
  std::vector<at::Tensor> held_, held_cache_;
  // the call's working memory
  Arena arena_;
  std::vector<Counter> counters_;
  std::vector<Scratch> scratch_;
  Barrier barrier_;
  bool profiling_ = false;
  double profile_[kPhases] = {};
};

}  // namespace
}  // namespace flashformer_cpu

TORCH_LIBRARY_FRAGMENT(flashformer, m) {
  using flashformer_cpu::NativeDecoder;
  m.class_<NativeDecoder>("NativeDecoder")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>())
      .def("set_embedding", &NativeDecoder::set_embedding)
      .def("set_positions", &NativeDecoder::set_positions)
      .def("set_rotary", &NativeDecoder::set_rotary)
      .def("set_rotary_scaling", &NativeDecoder::set_rotary_scaling)
      .def("set_norm", &NativeDecoder::set_norm)
      .def("add_part", &NativeDecoder::add_part)
      .def("set_attention", &NativeDecoder::set_attention)
      .def("set_feed_forward", &NativeDecoder::set_feed_forward)
      .def("set_logit_softcap", &NativeDecoder::set_logit_softcap)
      .def("finish", &NativeDecoder::finish)
      .def("bind_cache", &NativeDecoder::bind_cache)
      .def("forward", &NativeDecoder::forward)
      .def("set_profiling", &NativeDecoder::set_profiling)
      .def("profile", &NativeDecoder::profile);
}
