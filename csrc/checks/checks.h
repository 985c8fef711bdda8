// Argument checks shared by the CPU and CUDA operators. Every message names the argument and
// says what was expected and what was given.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "../fp8_common.h"

namespace transformer_fp8 {

inline std::string describe(const at::Tensor& t) {
  std::string s = std::string(c10::toString(t.scalar_type())) + " tensor of shape " +
                  c10::str(t.sizes()) + " on " + t.device().str();
  return s;
}

inline void check_defined(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), "transformer_fp8: argument '", name, "' must be a tensor, got None");
}

inline void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), "transformer_fp8: argument '", name,
              "' must be on the same device as '", ref_name, "' (", ref.device(), "), got ",
              describe(t));
}

// A per-tensor scale, scale_inv or amax slot: one float32 element on x's device.
inline void check_scalar_f32(const at::Tensor& t, const char* name, const at::Tensor& ref,
                             const char* ref_name) {
  check_defined(t, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1, "transformer_fp8: argument '",
              name, "' must be a 1-element float32 tensor, got ", describe(t));
  check_same_device(t, name, ref, ref_name);
}

// Whether the memory of two tensors (from each one's first to its last element) intersects.
inline bool memory_overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0 ||
      a.device() != b.device()) {
    return false;
  }
  auto range = [](const at::Tensor& t) {
    int64_t last = 0;  // (torch strides are never negative)
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto* begin = static_cast<const char*>(t.data_ptr());
    return std::make_pair(begin, begin + (last + 1) * t.element_size());
  };
  const auto [a_begin, a_end] = range(a);
  const auto [b_begin, b_end] = range(b);
  return a_begin < b_end && b_begin < a_end;
}

using NamedTensors = std::initializer_list<std::pair<const char*, const at::Tensor*>>;

// The amax slot, written in place (the max of itself and what the operator sees): a 1-element
// float32 tensor on x's device, not a lazily negated view (it would be written through its raw
// memory) and apart from every argument it would otherwise change (nullptr entries skipped).
inline void check_amax_slot(const at::Tensor& amax, const at::Tensor& x, NamedTensors inputs) {
  check_scalar_f32(amax, "amax", x, "x");
  TORCH_CHECK(!amax.is_neg() && !amax.is_conj(), "transformer_fp8: argument 'amax' is written "
              "in place and must not be a negated or conjugated view; pass amax.resolve_neg()");
  for (const auto& [name, t] : inputs) {
    TORCH_CHECK(t == nullptr || !memory_overlaps(amax, *t), "transformer_fp8: argument 'amax' "
                "is written in place and must not share memory with argument '", name, "'");
  }
}

inline void check_high_precision(const at::Tensor& t, const char* name) {
  check_defined(t, name);
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
              "transformer_fp8: argument '", name,
              "' must be float32, bfloat16 or float16, got ", describe(t));
}

inline bool is_fp8(at::ScalarType st) {
  return st == at::kFloat8_e4m3fn || st == at::kFloat8_e5m2;
}

inline Fp8Format check_fp8_dtype(at::ScalarType st, const char* name) {
  TORCH_CHECK(is_fp8(st), "transformer_fp8: argument '", name,
              "' must be torch.float8_e4m3fn or torch.float8_e5m2, got ", c10::toString(st));
  return st == at::kFloat8_e4m3fn ? Fp8Format::E4M3 : Fp8Format::E5M2;
}

inline void check_fp8_tensor(const at::Tensor& t, const char* name) {
  check_defined(t, name);
  TORCH_CHECK(is_fp8(t.scalar_type()), "transformer_fp8: argument '", name,
              "' must be a float8_e4m3fn or float8_e5m2 tensor, got ", describe(t));
}

inline HpType hp_type_of(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return HpType::Float32;
    case at::kBFloat16: return HpType::BFloat16;
    default: return HpType::Float16;
  }
}

// Checks of cast_to_fp8 / cast_transpose_to_fp8, identical on every backend.
inline Fp8Format check_cast_args(const at::Tensor& x, const at::Tensor& scale,
                                 at::ScalarType fp8_dtype, const c10::optional<at::Tensor>& amax) {
  check_high_precision(x, "x");
  check_scalar_f32(scale, "scale", x, "x");
  if (amax.has_value()) check_amax_slot(*amax, x, {{"x", &x}, {"scale", &scale}});
  return check_fp8_dtype(fp8_dtype, "fp8_dtype");
}

inline void check_dequant_args(const at::Tensor& x_fp8, const at::Tensor& scale_inv,
                               at::ScalarType dtype) {
  check_fp8_tensor(x_fp8, "x_fp8");
  check_scalar_f32(scale_inv, "scale_inv", x_fp8, "x_fp8");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "transformer_fp8: argument 'dtype' must be torch.float32, torch.bfloat16 or "
              "torch.float16, got ", c10::toString(dtype));
}

inline void check_margin(int64_t margin) {
  TORCH_CHECK(margin >= 0 && margin <= 1000, "transformer_fp8: argument 'margin' must be an "
              "integer in [0, 1000], got ", margin);
}

inline void check_compute_scale_args(const at::Tensor& amax, double fp8_max, int64_t margin) {
  check_defined(amax, "amax");
  TORCH_CHECK(amax.scalar_type() == at::kFloat, "transformer_fp8: argument 'amax' must be a "
              "float32 tensor, got ", describe(amax));
  TORCH_CHECK(std::isfinite(fp8_max) && fp8_max > 0, "transformer_fp8: argument 'fp8_max' must "
              "be finite and positive, got ", fp8_max);
  check_margin(margin);
}

inline AmaxAlgo parse_amax_algo(c10::string_view algo) {
  if (algo == "max") return AmaxAlgo::Max;
  if (algo == "most_recent") return AmaxAlgo::MostRecent;
  TORCH_CHECK(false, "transformer_fp8: argument 'amax_compute_algo' must be \"max\" or "
              "\"most_recent\", got \"", std::string(algo), "\"");
}

// update_delayed_scaling: lists of equal length, each history [L, n] with L >= 1, scale and
// scale_inv [n], all float32, contiguous, on one device; fp8_maxes finite and positive.
inline void check_delayed_scaling_args(at::TensorList histories, at::TensorList scales,
                                       at::TensorList scale_invs, at::ArrayRef<double> fp8_maxes,
                                       int64_t margin) {
  const size_t count = histories.size();
  TORCH_CHECK(count > 0, "transformer_fp8: argument 'amax_histories' must be a non-empty list, "
              "got an empty list");
  TORCH_CHECK(scales.size() == count && scale_invs.size() == count && fp8_maxes.size() == count,
              "transformer_fp8: 'amax_histories', 'scales', 'scale_invs' and 'fp8_maxes' must "
              "have the same length, got ", count, ", ", scales.size(), ", ", scale_invs.size(),
              " and ", fp8_maxes.size());
  check_margin(margin);
  const at::Device device = histories[0].device();
  for (size_t i = 0; i < count; ++i) {
    const at::Tensor& h = histories[i];
    const at::Tensor& s = scales[i];
    const at::Tensor& si = scale_invs[i];
    // The messages are built only when a check fails (TORCH_CHECK formats them lazily): this
    // runs for every tensor of a training step.
    TORCH_CHECK(h.dim() == 2 && h.size(0) >= 1 && h.scalar_type() == at::kFloat &&
                h.is_contiguous(), "transformer_fp8: argument 'amax_histories[", i,
                "]' must be a contiguous float32 tensor of shape [L >= 1, n], got ", describe(h));
    const int64_t n = h.size(1);
    TORCH_CHECK(s.dim() == 1 && s.size(0) == n && s.scalar_type() == at::kFloat &&
                s.is_contiguous(), "transformer_fp8: argument 'scales[", i,
                "]' must be a contiguous float32 tensor of shape [", n, "] to match "
                "amax_histories[", i, "], got ", describe(s));
    TORCH_CHECK(si.dim() == 1 && si.size(0) == n && si.scalar_type() == at::kFloat &&
                si.is_contiguous(), "transformer_fp8: argument 'scale_invs[", i,
                "]' must be a contiguous float32 tensor of shape [", n, "] to match "
                "amax_histories[", i, "], got ", describe(si));
    TORCH_CHECK(h.device() == device && s.device() == device && si.device() == device,
                "transformer_fp8: every tensor of update_delayed_scaling must be on ", device,
                "; at index ", i, " got amax_histories on ", h.device(), ", scales on ",
                s.device(), ", scale_invs on ", si.device());
    TORCH_CHECK(std::isfinite(fp8_maxes[i]) && fp8_maxes[i] > 0,
                "transformer_fp8: argument 'fp8_maxes[", i, "]' must be finite and positive, "
                "got ", fp8_maxes[i]);
  }
  // Every tensor is updated in place exactly once: memory shared by two of them (the same
  // tensor twice, a scale that is a row of a history, overlapping views) would be rewritten by
  // both updates (on CUDA, by two blocks at once). The tensors are contiguous, so each covers
  // one byte range; sorted by start, any overlap is between neighbours' ranges.
  struct Range {
    uintptr_t begin, end;
    const char* list;
    size_t index;
  };
  std::vector<Range> ranges;
  ranges.reserve(3 * count);
  const char* names[3] = {"amax_histories", "scales", "scale_invs"};
  int list_index = 0;
  for (at::TensorList list : {histories, scales, scale_invs}) {
    for (size_t i = 0; i < count; ++i) {
      if (list[i].numel() == 0) continue;
      const auto begin = reinterpret_cast<uintptr_t>(list[i].data_ptr());
      ranges.push_back({begin, begin + list[i].numel() * list[i].element_size(),
                        names[list_index], i});
    }
    ++list_index;
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& x, const Range& y) { return x.begin < y.begin; });
  uintptr_t furthest_end = 0;
  const Range* furthest = nullptr;
  for (const Range& r : ranges) {
    TORCH_CHECK(furthest == nullptr || r.begin >= furthest_end, "transformer_fp8: "
                "update_delayed_scaling: '", r.list, "[", r.index, "]' shares memory with '",
                furthest == nullptr ? "" : furthest->list, "[",
                furthest == nullptr ? 0 : furthest->index, "]'; each history, scale and "
                "scale_inv must be a tensor of its own, overlapping no other");
    if (r.end > furthest_end) {
      furthest_end = r.end;
      furthest = &r;
    }
  }
}

}  // namespace transformer_fp8
