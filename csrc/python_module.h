// The Python module transformer_fp8._C (csrc/python_module.cpp): what Python calls directly,
// without the dispatcher, where the host cost of every call matters (a pybind11 call converts
// its arguments in a fraction of the time torch.ops takes). Each file binds its own.
#pragma once

#include <torch/extension.h>

namespace transformer_fp8 {

void bind_delayed_scaling_batch(pybind11::module_& module);  // prepared_update.cpp
void bind_linear_steps(pybind11::module_& module);           // linear_step.cpp
void bind_norm_mlp_step(pybind11::module_& module);          // norm_mlp_step.cpp

}  // namespace transformer_fp8
