// What the operators (operators_cpu.cpp) and the native decoder (decoder_cpu.cpp) need of ATen: the
// checks of a call's arguments, index tensors read as int64, a cache pool's element type, and the
// no-backward autograd kernel. The kernels' translation units never include it (quantized_common.h).

#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "kv_blocks.h"
#include "quantized_common.h"

namespace flashformer_cpu {

// A linear's x (M, K) float32, its packed weight (groups of group_rows output rows) and bias.
inline void check_common(const at::Tensor& x, const at::Tensor& qweight, const std::optional<at::Tensor>& bias,
                  int64_t out_features, int64_t k, int64_t group_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x: expected a 2-D float32 CPU tensor, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) == k, "x: expected ", k, " columns (the packed weight's in_features), got ", x.sizes());
  TORCH_CHECK(qweight.is_contiguous(), "qweight: expected a contiguous tensor");
  const int64_t groups = qweight.size(0);
  TORCH_CHECK(out_features > (groups - 1) * group_rows && out_features <= groups * group_rows,
              "out_features: ", out_features, " does not fit ", groups, " groups of ", group_rows, " rows");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(),
                "bias: expected a contiguous float32 tensor of shape (", out_features, "), got ", bias->sizes());
  }
}

// The type a pool of rows of `dim` values holds, from its dtype and last dim (a uint8 pool's row
// of q8_0 or q4_0 blocks is told apart by its bytes), or -1 if it holds none of them.
inline int kv_type_of(at::ScalarType dtype, int64_t last, int64_t dim) {
  if (dtype == at::kFloat) return last == dim ? kKvFloat32 : -1;
  if (dtype == at::kHalf) return last == dim ? kKvFloat16 : -1;
  if (dtype != at::kByte || dim % kKvBlock != 0) return -1;
  if (last == kv_row_bytes(kKvQ8_0, dim)) return kKvQ8_0;
  if (last == kv_row_bytes(kKvQ4_0, dim)) return kKvQ4_0;
  return -1;
}

// An index tensor's values as int64, copied straight from int32 (the engine's tables and lengths)
// or int64 memory: the same numbers without the ATen tensors a `.to(kLong)` allocates (a few
// microseconds each, two a layer, 30 layers a decode step).
inline std::vector<int64_t> index_values(const at::Tensor& t, const char* name) {
  const at::Tensor c = t.contiguous();
  std::vector<int64_t> values(static_cast<size_t>(c.numel()));
  if (c.scalar_type() == at::kInt) {
    const int32_t* data = c.data_ptr<int32_t>();
    std::copy(data, data + c.numel(), values.begin());
  } else {
    TORCH_CHECK(c.scalar_type() == at::kLong, name, ": expected int32 or int64, got ", c.scalar_type());
    const int64_t* data = c.data_ptr<int64_t>();
    std::copy(data, data + c.numel(), values.begin());
  }
  return values;
}

// Where x or the bias asks for gradients, `out` gets a backward node that raises: the weights
// are integer buffers. Shared by every quantized operator's autograd kernel.
inline void refuse_backward(const char* name, at::Tensor& out, const at::Tensor& x,
                            const std::optional<at::Tensor>& bias) {
  if (torch::autograd::compute_requires_grad(x, bias)) {
    auto error = c10::make_intrusive<torch::autograd::Error>(
        std::string(name) +
            ": flashformer's quantized linear layers have no backward pass: their weights are integer "
            "buffers. Train or fine-tune the float model, then quantize it.",
        torch::autograd::collect_next_edges(x, bias));
    torch::autograd::set_history(out, error);
  }
}

using LinearSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const std::optional<at::Tensor>&, int64_t, bool);

template <const char* kName>
at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const std::optional<at::Tensor>& bias, int64_t out_features, bool int8_activations) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(kName, "").typed<LinearSignature>();
  at::Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = op.call(x, qweight, scales, bias, out_features, int8_activations);
  }
  refuse_backward(kName, out, x, bias);
  return out;
}

}  // namespace flashformer_cpu
