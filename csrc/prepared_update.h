// The delayed-scaling update of a list of (history, scale, scale_inv) triples that has already
// been checked: what the operator update_delayed_scaling runs after its checks, and what a
// DelayedScalingBatch (prepared_update.cpp) runs on every training step. One runner per device
// type, registered by the backend's file (csrc/cpu/scaling.cpp, csrc/cuda/kernels/scaling_ops.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <vector>

#include "fp8_common.h"

namespace transformer_fp8 {

// One history [L, n] (float32, contiguous) with its scale [n] and scale_inv [n]: what the
// update reads and writes per tensor.
struct UpdateTensor {
  float* history;
  float* scale;
  float* scale_inv;
  int64_t history_len;
  int64_t columns;
  double fp8_max;
};

// The update of count tensors on ``device``, already checked (check_delayed_scaling_args: no
// two overlapping, every one float32, contiguous and on ``device``).
using UpdateRunner = void (*)(const UpdateTensor* tensors, size_t count, int margin,
                              AmaxAlgo algo, c10::Device device);

// What the runners take, from lists that check_delayed_scaling_args has accepted.
inline std::vector<UpdateTensor> update_tensors(at::TensorList histories, at::TensorList scales,
                                                at::TensorList scale_invs,
                                                at::ArrayRef<double> fp8_maxes) {
  std::vector<UpdateTensor> tensors(histories.size());
  for (size_t i = 0; i < tensors.size(); ++i)
    tensors[i] = {histories[i].data_ptr<float>(), scales[i].data_ptr<float>(),
                  scale_invs[i].data_ptr<float>(), histories[i].size(0), histories[i].size(1),
                  fp8_maxes[i]};
  return tensors;
}

// The runner of a device type (nullptr where this build has none).
UpdateRunner& update_runner(c10::DeviceType device);

struct RegisterUpdateRunner {
  RegisterUpdateRunner(c10::DeviceType device, UpdateRunner runner) {
    update_runner(device) = runner;
  }
};

}  // namespace transformer_fp8
