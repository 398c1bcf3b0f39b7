// flashformer's C++ operators, whose schemas operators.py defines: the glue between ATen's tensors
// and the kernels, and their registrations. The linears on packed weights (int4_linear, int5_linear,
// int8_linear: quantized_cpu.cpp's kernels; q4_k_linear, q5_k_linear, q6_k_linear: kquants_cpu.cpp's;
// mxfp4_linear: mxfp4_cpu.cpp's),
// the attention over cached keys (paged_attention_cpu, attention_cpu: paged_attention_cpu.cpp's
// tasks), and the ISA switch (quantized_kernel_isa) with its record (kernels_ran). Each checks its
// arguments, prepares x and hands the units of work to at::parallel_for.
// Compiled in bindings_cpu.cpp's unit, with the decoder: all of the operators here, not beside
// their kernels, because ATen's headers take ~9 s to compile each time a unit includes them (a
// third of the first build's time when every kernel's file did); the kernels' files include none.

#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "attention_tasks.h"
#include "kv_blocks.h"
#include "operators_common.h"
#include "packings.h"

namespace flashformer_cpu {
namespace {

// Memory for x's prepared forms, owned by an operator's call.
struct ProductXStorage {
  std::vector<int8_t> q;
  std::vector<float> d, s, sums;
  std::vector<int32_t> offset;
  std::vector<int16_t> sums16;
  std::vector<AmxXBlock> amx;

  // x (rows, k) float32, its form made ready (in parallel) for `form`.
  ProductX prepare(const float* xp, int64_t rows, int64_t k, XForm form) {
    ProductX x;
    x.x = xp, x.rows = rows, x.k = k;
    if (form == kXFloat) return x;
    const int64_t items = rows * (k / form_block(form));
    if (form == kXBlocks32) {
      q.resize(items * kBlock), d.resize(items), s.resize(items), offset.resize(items);
      x.blocks32 = {k / kBlock, q.data(), d.data(), s.data(), offset.data()};
    } else if (form == kXBlocks256) {
      q.resize(items * kSuper), d.resize(items), sums16.resize(items * 16);
      x.blocks256 = {k / kSuper, q.data(), d.data(), sums16.data()};
    } else if (form == kXAmx256) {
      amx.resize((rows + 15) / 16 * (k / kSuper));
      x.amx256 = {k / kSuper, amx.data()};
    } else {
      sums.resize(items);
      x.sums32 = sums.data();
    }
    at::parallel_for(0, items, form_block(form) == kSuper ? 256 : 2048,
                     [&](int64_t first, int64_t last) { prepare_x(form, x, first, last); });
    return x;
  }
};

// The linears: check, prepare x, and run every unit of the product with at::parallel_for.
at::Tensor run_operator(const PackedMatrix& w, const at::Tensor& x_in, const std::optional<at::Tensor>& bias,
                        bool int8_activations) {
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = w.n;
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const int isa = use_isa().load();
  ProductXStorage storage;
  const ProductX xp = storage.prepare(x.data_ptr<float>(), rows, w.k, x_form(w.packing, int8_activations, rows, isa));
  const OutputMatrix result{out.data_ptr<float>(), n, bias ? bias->data_ptr<float>() : nullptr, n};
  const int64_t units = product_units(w, rows, int8_activations, isa);
  at::parallel_for(0, units, unit_grain(w, rows, units), [&](int64_t first, int64_t last) {
    product_run(w, xp, result, int8_activations, isa, first, last);
  });
  return out;
}

template <Packing kPacking>
at::Tensor nibble_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                         const std::optional<at::Tensor>& bias, int64_t out_features, bool int8_activations) {
  const int64_t groups = qweight.size(0), nb = qweight.size(1);
  TORCH_CHECK(scales.dim() == 4 && scales.size(0) == groups && scales.size(1) == nb && scales.size(2) == 2 &&
                  scales.size(3) == kNibbleGroupRows && scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "scales: expected contiguous float16 (", groups, ", ", nb, ", 2, 8), got ", scales.sizes());
  check_common(x, qweight, bias, out_features, nb * kBlock, kNibbleGroupRows);
  const PackedMatrix w{kPacking, qweight.data_ptr(), scales.data_ptr(), out_features,
                       nb * kBlock, groups, nb};
  return run_operator(w, x, bias, int8_activations);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t out_features, bool int8_activations) {
  TORCH_CHECK(qweight.dim() == 4 && qweight.size(2) == kNibbleGroupRows && qweight.size(3) == 16 &&
                  qweight.scalar_type() == at::kByte,
              "qweight: expected uint8 (groups, blocks, 8, 16), got ", qweight.sizes(), " ", qweight.scalar_type());
  return nibble_linear<kInt4>(x, qweight, scales, bias, out_features, int8_activations);
}

at::Tensor int5_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t out_features, bool int8_activations) {
  TORCH_CHECK(qweight.dim() == 3 && qweight.size(2) == kInt5BlockBytes &&
                  qweight.scalar_type() == at::kByte,
              "qweight: expected uint8 (groups, blocks, 160), got ", qweight.sizes(), " ", qweight.scalar_type());
  return nibble_linear<kInt5>(x, qweight, scales, bias, out_features, int8_activations);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias, int64_t out_features, bool int8_activations) {
  TORCH_CHECK(qweight.dim() == 4 && qweight.size(2) == kInt8GroupRows && qweight.size(3) == kBlock &&
                  qweight.scalar_type() == at::kChar,
              "qweight: expected int8 (groups, blocks, 4, 32), got ", qweight.sizes(), " ", qweight.scalar_type());
  const int64_t groups = qweight.size(0), nb = qweight.size(1);
  const bool per_block = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(scales.is_contiguous(), "scales: expected a contiguous tensor");
  if (per_block) {
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == groups && scales.size(1) == nb && scales.size(2) == kInt8GroupRows,
                "scales: expected float16 (", groups, ", ", nb, ", 4) per block, got ", scales.sizes());
  } else {
    TORCH_CHECK(scales.dim() == 1 && scales.size(0) == groups * kInt8GroupRows && scales.scalar_type() == at::kFloat,
                "scales: expected float32 (", groups * kInt8GroupRows, ",) per row, got ", scales.sizes(), " ",
                scales.scalar_type());
  }
  check_common(x, qweight, bias, out_features, nb * kBlock, kInt8GroupRows);
  const PackedMatrix w{per_block ? kInt8PerBlock : kInt8PerRow, qweight.data_ptr(), scales.data_ptr(), out_features,
                       nb * kBlock, groups, nb};
  return run_operator(w, x, bias, int8_activations);
}

// x (M, K) float32 -> (M, K): its rounding error under int8 blocks of `block` values (products.h).
at::Tensor int8_residual_op(const at::Tensor& x_in, int64_t block) {
  TORCH_CHECK(block == kBlock || block == kSuper, "block: expected 32 or 256 (an int8 form's block), got ", block);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu() && x_in.size(1) % block == 0,
              "x: expected a 2-D float32 CPU tensor of whole blocks of ", block, " columns, got ", x_in.sizes(), " ",
              x_in.scalar_type());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t k = x.size(1);
  at::parallel_for(0, x.size(0), 1, [&](int64_t first, int64_t last) {
    int8_residual(x.data_ptr<float>() + first * k, last - first, k, block, out.data_ptr<float>() + first * k);
  });
  return out;
}

int64_t quantized_kernel_isa(int64_t request) {
  if (request >= 0) use_isa().store(std::min<int>(static_cast<int>(request), best_isa()));
  return use_isa().load();
}

// Each family's ISAs run since the last reset (a bit per Isa; quantized_common.h's Family order).
std::vector<int64_t> kernels_ran(bool reset) {
  std::vector<int64_t> ran(kFamilies);
  for (int f = 0; f < kFamilies; ++f) ran[f] = reset ? families_ran()[f].exchange(0) : families_ran()[f].load();
  return ran;
}

// packings.h's table, a row a packing in its order, for Python (native_decoder.packings() and the
// test that holds it to kernels/layouts.py): "name layout group_rows block_values group_block_bytes scales".
std::vector<std::string> packings() {
  std::vector<std::string> rows;
  for (const PackingTraits& t : kPackings) {
    rows.push_back(std::string(t.name) + " " + (*t.layout ? t.layout : "-") + " " + std::to_string(t.group_rows) +
                   " " + std::to_string(t.block_values) + " " + std::to_string(t.group_block_bytes) + " " +
                   (t.scales ? "1" : "0"));
  }
  return rows;
}

constexpr char kInt4Linear[] = "flashformer::int4_linear";
constexpr char kInt5Linear[] = "flashformer::int5_linear";
constexpr char kInt8Linear[] = "flashformer::int8_linear";

// The linears on the file's blocks (the K-quants, MXFP4): their blocks hold their own scales.
template <Packing kPacking>
at::Tensor kquant_linear(const at::Tensor& x_in, const at::Tensor& blocks, const std::optional<at::Tensor>& bias,
                         int64_t out_features, bool int8_activations) {
  constexpr int64_t kBlockBytes = kPackings[kPacking].group_block_bytes;
  constexpr int64_t kValues = kPackings[kPacking].block_values;
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == kBlockBytes && blocks.scalar_type() == at::kByte &&
                  blocks.is_contiguous(),
              "blocks: expected contiguous uint8 (out_features, in_features / ", kValues, ", ", kBlockBytes,
              "), got ", blocks.sizes(), " ", blocks.scalar_type());
  const int64_t nb = blocks.size(1), k = nb * kValues;
  TORCH_CHECK(blocks.size(0) == out_features, "out_features: ", out_features, " does not match blocks of ",
              blocks.size(0), " rows");
  check_common(x_in, blocks, bias, out_features, k, 1);
  const PackedMatrix w{kPacking, blocks.data_ptr(), nullptr, out_features, k, out_features, nb};
  return run_operator(w, x_in, bias, int8_activations);
}

using KQuantSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                                   bool);

// The no-backward kernel of quantized_common.h's linear_autograd, for this signature.
template <const char* kName>
at::Tensor kquant_autograd(const at::Tensor& x, const at::Tensor& blocks, const std::optional<at::Tensor>& bias,
                           int64_t out_features, bool int8_activations) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(kName, "").typed<KQuantSignature>();
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = op.call(x, blocks, bias, out_features, int8_activations);
  }
  refuse_backward(kName, out, x, bias);
  return out;
}

constexpr char kQ4KName[] = "flashformer::q4_k_linear";
constexpr char kQ5KName[] = "flashformer::q5_k_linear";
constexpr char kQ6KName[] = "flashformer::q6_k_linear";
constexpr char kMxfp4Name[] = "flashformer::mxfp4_linear";

// The values' Dv: a float pool's last dim, a block pool's D (its rows hold D values' blocks).
int64_t value_dim(const at::Tensor& v_pool, int64_t dim) {
  return v_pool.scalar_type() == at::kByte ? dim : v_pool.size(-1);
}

// Both operators' common part: q (T, Hq, D) contiguous, the pools (Hk, num_blocks, block_size, D)
// with a contiguous last dim, and each of the S sequences' block table (max_blocks entries), key
// count and first query row. Writes out (T, Hq, Dv) and lse (T, Hq): tensors whose memory is laid
// out so (the callers choose their shapes and strides).
void attend(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                          int64_t sequences, const int64_t* tables, int64_t max_blocks,
                                          const int64_t* lengths, const int64_t* starts, double scale, double softcap,
                                          bool causal, const std::optional<at::Tensor>& alibi_slopes,
                                          const std::optional<at::Tensor>& key_padding, int64_t window_left,
                                          int64_t window_right, at::Tensor& out, at::Tensor& lse) {
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.dim() == 4, "k, v: expected tensors of 4 dims, got ", k_pool.sizes(),
              " and ", v_pool.sizes());
  const int64_t dim = q.size(2), dim_v = value_dim(v_pool, dim);
  const int k_type = kv_type_of(k_pool.scalar_type(), k_pool.size(3), dim);
  const int v_type = kv_type_of(v_pool.scalar_type(), v_pool.size(3), dim_v);
  TORCH_CHECK(k_type >= 0 && v_type >= 0, "k, v: expected float32, float16 or uint8 q8_0 / q4_0 rows for D = ", dim,
              " (", kv_row_bytes(kKvQ8_0, dim), " or ", kv_row_bytes(kKvQ4_0, dim), " bytes, D a multiple of 32), got ",
              k_pool.sizes(), " ", k_pool.scalar_type(), " and ", v_pool.sizes(), " ", v_pool.scalar_type());
  const at::Tensor k = k_pool.stride(3) == 1 ? k_pool : k_pool.contiguous();
  const at::Tensor v = v_pool.stride(3) == 1 ? v_pool : v_pool.contiguous();
  const int64_t tokens = q.size(0);
  Problem p{};
  p.q_heads = q.size(1), p.dim = dim;
  p.kv_heads = k.size(0), p.block_size = k.size(2);
  p.dim_v = dim_v;
  p.k_type = k_type, p.v_type = v_type;
  p.k_head_stride = k.stride(0), p.k_block_stride = k.stride(1), p.k_pos_stride = k.stride(2);
  p.v_head_stride = v.stride(0), p.v_block_stride = v.stride(1), p.v_pos_stride = v.stride(2);
  at::Tensor slopes, padding;
  if (alibi_slopes) {
    slopes = alibi_slopes->to(at::kFloat).contiguous();
    p.slopes = slopes.data_ptr<float>();
    p.slope_rows = slopes.size(0);
  }
  if (key_padding) {
    padding = key_padding->to(at::kBool).contiguous();
    TORCH_CHECK(padding.dim() == 2 && padding.size(0) == sequences, "key_padding: expected (S, L) bool for ",
                sequences, " sequences, got ", padding.sizes());
    p.key_padding = padding.data_ptr<bool>();
    p.padding_len = padding.size(1);
  }
  p.q = q.data_ptr<float>(), p.q_row_stride = p.q_heads * p.dim, p.k = k.data_ptr(), p.v = v.data_ptr();
  p.out = out.data_ptr<float>(), p.lse = lse.data_ptr<float>();
  p.scale = static_cast<float>(scale), p.softcap = static_cast<float>(softcap), p.causal = causal;
  p.window_left = window_left, p.window_right = window_right;
  for (int64_t b = 0; b < sequences; ++b) {
    TORCH_CHECK(starts[b] <= starts[b + 1] && starts[b + 1] <= tokens,
                "q_starts: expected a non-decreasing run from 0 to ", tokens, " (q's rows)");
    TORCH_CHECK(!key_padding || lengths[b] <= p.padding_len, "key_padding: ", p.padding_len,
                " positions for a sequence of ", lengths[b], " keys");
  }
  TORCH_CHECK(starts[0] == 0 && starts[sequences] == tokens, "q_starts: expected to start at 0 and end at ", tokens);
  const std::vector<Task> tasks = attention_tasks(sequences, starts, lengths, p.kv_heads, causal);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Task& t = tasks[i];
      attend_task(p, t, tables + t.b * max_blocks, scratch);
    }
  });
}

// The paged operator: q (T, Hq, D) packed, pools, block_tables (S, max_blocks), seq_lens (S,),
// q_starts (S + 1,).
std::tuple<at::Tensor, at::Tensor> paged_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_pool,
                                                       const at::Tensor& v_pool, const at::Tensor& block_tables,
                                                       const at::Tensor& seq_lens, const at::Tensor& q_starts,
                                                       double scale, double softcap, bool causal,
                                                       const std::optional<at::Tensor>& alibi_slopes,
                                                       const std::optional<at::Tensor>& key_padding,
                                                       int64_t window_left, int64_t window_right) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "q: expected float32 (T, Hq, D), got ",
              q_in.sizes(), " ", q_in.scalar_type());
  TORCH_CHECK(block_tables.dim() == 2, "block_tables: expected (S, max_blocks), got ", block_tables.sizes());
  const std::vector<int64_t> tables = index_values(block_tables, "block_tables");
  const std::vector<int64_t> lengths = index_values(seq_lens, "seq_lens");
  const std::vector<int64_t> starts = index_values(q_starts, "q_starts");
  const int64_t sequences = block_tables.size(0);
  TORCH_CHECK(static_cast<int64_t>(lengths.size()) == sequences &&
                  static_cast<int64_t>(starts.size()) == sequences + 1,
              "seq_lens (S,) and q_starts (S + 1,) must match block_tables (S, max_blocks)");
  const at::Tensor q = q_in.contiguous();
  at::Tensor out = at::empty({q.size(0), q.size(1), value_dim(v_pool, q.size(2))}, q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options());
  attend(q, k_pool, v_pool, sequences, tables.data(), block_tables.size(1), lengths.data(), starts.data(), scale,
         softcap, causal, alibi_slopes, key_padding, window_left, window_right, out, lse);
  return {out, lse};
}

// The static-cache operator: q (B, Hq, Lq, D), k (B, Hk, Lk, D) and v (B, Hk, Lk, Dv) in any
// strides with a contiguous last dim (a cache's view is read in place), Lq queries a row at the
// last Lq of its Lk positions. Returns out (B, Hq, Lq, Dv) and lse (B, Hq, Lq), laid out in memory
// as (B, Lq, Hq, ...): merging the heads afterwards is free.
std::tuple<at::Tensor, at::Tensor> attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 double scale, double softcap, bool causal,
                                                 const std::optional<at::Tensor>& alibi_slopes,
                                                 const std::optional<at::Tensor>& key_padding, int64_t window_left,
                                                 int64_t window_right) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat, "q: expected float32 (B, Hq, Lq, D), got ", q.sizes(),
              " ", q.scalar_type());
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.size(0) == q.size(0) && v.size(0) == q.size(0) &&
                  k.size(2) == v.size(2),
              "k, v: expected (B, Hk, Lk, D) and (B, Hk, Lk, Dv) for q ", q.sizes(), ", got ", k.sizes(), " and ",
              v.sizes());
  const int64_t batch = q.size(0), q_len = q.size(2), k_len = k.size(2);
  std::vector<int64_t> tables(batch), lengths(batch, k_len), starts(batch + 1);
  for (int64_t b = 0; b <= batch; ++b) {
    if (b < batch) tables[b] = b;
    starts[b] = b * q_len;
  }
  const at::Tensor packed = q.transpose(1, 2).reshape({batch * q_len, q.size(1), q.size(3)}).contiguous();
  const int64_t heads = q.size(1), dim_v = value_dim(v, q.size(3));
  at::Tensor out = at::empty_strided({batch, heads, q_len, dim_v}, {q_len * heads * dim_v, dim_v, heads * dim_v, 1},
                                     q.options());
  at::Tensor lse = at::empty_strided({batch, heads, q_len}, {q_len * heads, 1, heads}, q.options());
  attend(packed, k.transpose(0, 1), v.transpose(0, 1), batch, tables.data(), 1, lengths.data(), starts.data(), scale,
         softcap, causal, alibi_slopes, key_padding, window_left, window_right, out, lse);
  return {out, lse};
}

}  // namespace
}  // namespace flashformer_cpu

using namespace flashformer_cpu;

TORCH_LIBRARY_IMPL(flashformer, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int5_linear", &int5_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("q4_k_linear", &kquant_linear<kQ4K>);
  m.impl("q5_k_linear", &kquant_linear<kQ5K>);
  m.impl("q6_k_linear", &kquant_linear<kQ6K>);
  m.impl("int8_residual", &int8_residual_op);
  m.impl("mxfp4_linear", &kquant_linear<kMxfp4>);
  m.impl("paged_attention_cpu", &paged_attention_cpu);
  m.impl("attention_cpu", &attention_cpu);
}

TORCH_LIBRARY_IMPL(flashformer, Autograd, m) {
  m.impl("int4_linear", &linear_autograd<kInt4Linear>);
  m.impl("int5_linear", &linear_autograd<kInt5Linear>);
  m.impl("int8_linear", &linear_autograd<kInt8Linear>);
  m.impl("q4_k_linear", &kquant_autograd<kQ4KName>);
  m.impl("q5_k_linear", &kquant_autograd<kQ5KName>);
  m.impl("q6_k_linear", &kquant_autograd<kQ6KName>);
  m.impl("mxfp4_linear", &kquant_autograd<kMxfp4Name>);
}

// An operator without tensor arguments dispatches to CompositeExplicitAutograd's kernel.
TORCH_LIBRARY_IMPL(flashformer, CompositeExplicitAutograd, m) {
  m.impl("quantized_kernel_isa", &quantized_kernel_isa);
  m.impl("kernels_ran", &kernels_ran);
  m.impl("packings", &packings);
}
