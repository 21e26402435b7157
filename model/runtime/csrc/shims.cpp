// C shims of the opaque operators a compiled graph calls (model.runtime.shims): the package's
// code calls them directly, through the C interface TorchInductor's own shims use, instead of
// through torch's proxy executor, which calls the operator back in Python under the GIL.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/layer_norm.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

using torch::aot_inductor::new_tensor_handle;
using torch::aot_inductor::pointer_to_optional;
using torch::aot_inductor::tensor_handle_to_tensor_pointer;

// nmt::layer_norm (model.runtime.encoder): ATen's own LayerNorm kernel, its result contiguous, as
// the operator's Python implementation returns it.
extern "C" AOTITorchError aoti_torch_cpu_layer_norm(
    AtenTensorHandle input,
    const int64_t* normalized_shape,
    int64_t normalized_shape_len_,
    AtenTensorHandle* weight,
    AtenTensorHandle* bias,
    double eps,
    int32_t cudnn_enable,
    AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor out = at::layer_norm(
        *tensor_handle_to_tensor_pointer(input),
        c10::IntArrayRef(normalized_shape, normalized_shape_len_),
        pointer_to_optional<at::Tensor>(weight),
        pointer_to_optional<at::Tensor>(bias),
        eps,
        cudnn_enable != 0);
    *ret0 = new_tensor_handle(out.contiguous());
  });
}

// nmt::int8_mm (model.runtime.int8mm) in a compiled graph: the kernel is csrc/int8mm.cpp's (this
// library's own copy); here the tensors are checked and the feature blocks shared between torch's
// threads. (An eager call goes through the operator's Python implementation, to the same kernel.)
extern "C" void nmt_int8_mm_blocks(const uint8_t* x, const int8_t* w, const int32_t* comp, int32_t* y,
                                   int64_t rows, int64_t in, int64_t out, int64_t first, int64_t last);

namespace nmt {

constexpr int64_t FEATURES = 16, GROUP = 4, BLOCKS = 4;  // as csrc/int8mm.cpp

// x: (rows, in) uint8, 1..127 (the activations + 64); w: (ceil(out / 16), in / 4, 16, 4) int8;
// comp: (ceil(out / 16) * 16) int32, 64 x each feature's weight sum. Returns (rows, out) int32.
at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& comp, int64_t out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kByte, "int8_mm: x must be (rows, in) uint8");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kChar && w.size(2) == FEATURES && w.size(3) == GROUP,
              "int8_mm: w must be (blocks, in / 4, 16, 4) int8");
  const int64_t rows = x.size(0), in = x.size(1), blocks = w.size(0);
  TORCH_CHECK(w.size(1) * GROUP == in, "int8_mm: x has ", in, " inputs, w ", w.size(1) * GROUP);
  TORCH_CHECK(out > (blocks - 1) * FEATURES && out <= blocks * FEATURES, "int8_mm: out does not match w");
  TORCH_CHECK(comp.scalar_type() == at::kInt && comp.numel() == blocks * FEATURES, "int8_mm: comp");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous(), cc = comp.contiguous();
  at::Tensor y = at::empty({rows, out}, x.options().dtype(at::kInt));
  if (rows == 0 || out == 0) return y;
  // Threads split the features, BLOCKS blocks at a time: each streams its own share of the weights.
  const int64_t groups = (blocks + BLOCKS - 1) / BLOCKS;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    nmt_int8_mm_blocks(xc.data_ptr<uint8_t>(), wc.data_ptr<int8_t>(), cc.data_ptr<int32_t>(),
                       y.data_ptr<int32_t>(), rows, in, out, begin * BLOCKS, std::min(blocks, end * BLOCKS));
  });
  return y;
}

}  // namespace nmt

extern "C" AOTITorchError aoti_torch_cpu_int8_mm(
    AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle comp, int64_t out, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor y = nmt::int8_mm(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(w),
                                *tensor_handle_to_tensor_pointer(comp), out);
    *ret0 = new_tensor_handle(std::move(y));
  });
}
