// C shims of the opaque operators a compiled graph calls (model.runtime.shims): the package's
// code calls them directly, through the C interface TorchInductor's own shims use, instead of
// through torch's proxy executor, which calls the operator back in Python under the GIL.
#include <ATen/core/Tensor.h>
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
