// Attention of a batch of sequences over a paged KV cache, on the CPU, in one call: the
// operator flashformer::paged_attention_cpu that attention/paged.py runs for backend "cpu"
// (its schema, argument checks and docs live there and in kernels/extension.py).
//
//   q (T, Hq, D) float32: the queries of S sequences packed one after another, sequence s's
//   rows q_starts[s] .. q_starts[s + 1] - 1 (q_starts (S + 1,) int64); k_pool (Hk, num_blocks,
//   block_size, D), v_pool (..., Dv) float32; block_tables (S, max_blocks) int32/int64; seq_lens
//   (S,) int32/int64. Query i of the n of sequence s sits at key position seq_lens[s] - n + i and
//   sees the keys at or before it (causal, bottom-right), within the window (window_left /
//   window_right keys before / after; -1: unbounded). softcap > 0: scores become
//   softcap * tanh(scores / softcap); alibi_slopes (S|1, Hq) adds -slope * |query position - key
//   position|. Returns out (T, Hq, Dv) and lse (T, Hq); a query with no key gets 0 and -inf.
//   (A batch of B rows of Lq queries each is the case q_starts = 0, Lq, 2 Lq, ...)
//
// Why this shape:
// - A decode step of a server attends every running sequence over its own blocks. Calling
//   attention() once per sequence and layer costs a gather and tens of microseconds of
//   dispatch each (16 sequences x 30 layers a step); this is one call per layer.
// - One task per (sequence, KV head): its G = Hq / Hk query heads (GQA) and Lq queries share
//   every key and value read; the blocks are read in place through the table, never gathered.
// - Batch invariance by construction: a task's arithmetic (which keys, in which order, the
//   block-by-block online softmax) depends on its own sequence only, and one thread computes
//   it. A sequence alone and in any batch gives the same bits.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// The dot product of two rows of n floats (a fixed order for a given n and CPU: the compiler's
// vector reduction, the same for every call).
__attribute__((always_inline)) inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  float* lse;
  int64_t q_heads, kv_heads, dim, dim_v, num_blocks, block_size, max_blocks;
  float scale, softcap;
  const float* slopes;  // (B|1, Hq) or nullptr
  int64_t slope_rows;
  int64_t window_left, window_right;  // -1: unbounded
};

// A thread's working memory, reused by its tasks: (rows,) max and sum, (rows, Dv) accumulators,
// (rows, block_size) scores.
struct Scratch {
  std::vector<float> m, l, acc, s;
};

// Sequence b, KV head h: its G x n queries (packed rows q0 .. q0 + n - 1) against its keys, block
// by block in order.
// Compiled for AVX2 and for any x86-64 CPU; the loader picks one per CPU, once.
#if defined(__x86_64__)
__attribute__((target_clones("avx2", "default")))
#endif
void attend_task(const Problem& p, int64_t b, int64_t h, int64_t seq_len, const int64_t* table, int64_t q0,
                 int64_t n, Scratch& scratch) {
  const int64_t group = p.q_heads / p.kv_heads, rows = group * n;
  const float kInf = std::numeric_limits<float>::infinity();
  std::vector<float>&m = scratch.m, &l = scratch.l, &acc = scratch.acc, &s = scratch.s;
  m.assign(rows, -kInf);
  l.assign(rows, 0.f);
  acc.assign(rows * p.dim_v, 0.f);
  s.resize(rows * p.block_size);
  const int64_t first_query = seq_len - n;  // row r's query sits at first_query + r % n
  const int64_t blocks = (seq_len + p.block_size - 1) / p.block_size;
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t key0 = j * p.block_size, keys = std::min(p.block_size, seq_len - key0);
    if (p.window_left >= 0 && key0 + keys - 1 < first_query - p.window_left) continue;  // before every window
    const int64_t block = table[j];
    const float* kb = p.k + (h * p.num_blocks + block) * p.block_size * p.dim;  // (block_size, D)
    const float* vb = p.v + (h * p.num_blocks + block) * p.block_size * p.dim_v;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t head = h * group + r / n, i = r % n, position = first_query + i;
      const float* qr = p.q + ((q0 + i) * p.q_heads + head) * p.dim;
      const float slope = p.slopes ? p.slopes[(b % p.slope_rows) * p.q_heads + head] : 0.f;
      float* sr = s.data() + r * p.block_size;
      float block_max = -kInf;
      for (int64_t t = 0; t < keys; ++t) {
        const int64_t key = key0 + t;
        const bool seen = key <= position && (p.window_left < 0 || key >= position - p.window_left) &&
                          (p.window_right < 0 || key <= position + p.window_right);
        float score = -kInf;
        if (seen) {
          score = dot(qr, kb + t * p.dim, p.dim) * p.scale;
          if (p.softcap > 0.f) score = p.softcap * std::tanh(score / p.softcap);
          if (p.slopes) score -= slope * static_cast<float>(std::abs(position - key));
        }
        sr[t] = score;
        block_max = std::max(block_max, score);
      }
      if (block_max == -kInf) continue;  // no key of this block for this query
      const float new_max = std::max(m[r], block_max);
      const float rescale = std::exp(m[r] - new_max);  // 0 for the first block seen
      float* ar = acc.data() + r * p.dim_v;
      float sum = 0.f;
      for (int64_t d = 0; d < p.dim_v; ++d) ar[d] *= rescale;
      for (int64_t t = 0; t < keys; ++t) {
        const float weight = std::exp(sr[t] - new_max);  // 0 for a key not seen
        sum += weight;
        const float* vt = vb + t * p.dim_v;
#pragma omp simd
        for (int64_t d = 0; d < p.dim_v; ++d) ar[d] += weight * vt[d];
      }
      l[r] = l[r] * rescale + sum;
      m[r] = new_max;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t head = h * group + r / n, i = r % n;
    const int64_t row = (q0 + i) * p.q_heads + head;
    float* o = p.out + row * p.dim_v;
    if (l[r] == 0.f) {
      std::fill(o, o + p.dim_v, 0.f);
      p.lse[row] = -kInf;
      continue;
    }
    const float inverse = 1.f / l[r];
    for (int64_t d = 0; d < p.dim_v; ++d) o[d] = acc[r * p.dim_v + d] * inverse;
    p.lse[row] = m[r] + std::log(l[r]);
  }
}

std::tuple<at::Tensor, at::Tensor> paged_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_pool,
                                                       const at::Tensor& v_pool, const at::Tensor& block_tables,
                                                       const at::Tensor& seq_lens, const at::Tensor& q_starts,
                                                       double scale, double softcap,
                                                       const std::optional<at::Tensor>& alibi_slopes,
                                                       int64_t window_left, int64_t window_right) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "q: expected float32 (T, Hq, D), got ",
              q_in.sizes(), " ", q_in.scalar_type());
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.scalar_type() == at::kFloat &&
                  v_pool.scalar_type() == at::kFloat,
              "k_pool, v_pool: expected contiguous float32 pools");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lengths = seq_lens.to(at::kLong).contiguous();
  const at::Tensor starts = q_starts.to(at::kLong).contiguous();
  const int64_t batch = tables.size(0), tokens = q.size(0);
  TORCH_CHECK(lengths.numel() == batch && starts.numel() == batch + 1,
              "seq_lens (S,) and q_starts (S + 1,) must match block_tables (S, max_blocks)");
  Problem p{};
  p.q_heads = q.size(1), p.dim = q.size(2);
  p.kv_heads = k_pool.size(0), p.num_blocks = k_pool.size(1), p.block_size = k_pool.size(2);
  p.dim_v = v_pool.size(3), p.max_blocks = tables.size(1);
  at::Tensor out = at::empty({tokens, p.q_heads, p.dim_v}, q.options());
  at::Tensor lse = at::empty({tokens, p.q_heads}, q.options());
  at::Tensor slopes;
  if (alibi_slopes) {
    slopes = alibi_slopes->to(at::kFloat).contiguous();
    p.slopes = slopes.data_ptr<float>();
    p.slope_rows = slopes.size(0);
  }
  p.q = q.data_ptr<float>(), p.k = k_pool.data_ptr<float>(), p.v = v_pool.data_ptr<float>();
  p.out = out.data_ptr<float>(), p.lse = lse.data_ptr<float>();
  p.scale = static_cast<float>(scale), p.softcap = static_cast<float>(softcap);
  p.window_left = window_left, p.window_right = window_right;
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(sp[b] <= sp[b + 1] && sp[b + 1] <= tokens, "q_starts: expected a non-decreasing run from 0 to ",
                tokens, " (q's rows)");
  }
  TORCH_CHECK(sp[0] == 0 && sp[batch] == tokens, "q_starts: expected to start at 0 and end at ", tokens);
  at::parallel_for(0, batch * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / p.kv_heads, h = task % p.kv_heads;
      attend_task(p, b, h, lp[b], tp + b * p.max_blocks, sp[b], sp[b + 1] - sp[b], scratch);
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashformer, CPU, m) {
  m.impl("paged_attention_cpu", &paged_attention_cpu);
}
