// DelayedScalingBatch: the tensors of one delayed-scaling update, checked once and kept, so that
// a training step's update is one call with no list to convert or check again (converting and
// checking 900 tensors cost ~100 us of host time per call). Every call still compares each
// tensor's address, type and shape with those it checked (a few ns per tensor) and checks them
// all again when any differs, so memory swapped behind its back (.data = ...) is never written
// through a stale pointer. (The tensors are held: their memory cannot be freed meanwhile.)
#include <ATen/record_function.h>

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "checks/checks.h"
#include "prepared_update.h"
#include "python_module.h"

namespace transformer_fp8 {

UpdateRunner& update_runner(c10::DeviceType device) {
  static std::array<UpdateRunner, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>
      runners{};
  return runners.at(static_cast<size_t>(device));
}

namespace {

// Where a checked tensor's data was and its shape: if a tensor still matches, the checks still
// hold for it (its memory is the same bytes, of the same type and layout).
struct Seen {
  const void* data;
  int64_t size0, size1;  // size1: -1 for a 1-d tensor
  caffe2::TypeMeta dtype;
  c10::Device device;

  static Seen of(const c10::TensorImpl* t) {
    return {address(t), t->size(0), t->dim() == 2 ? t->size(1) : -1, t->dtype(), t->device()};
  }
  static const void* address(const c10::TensorImpl* t) {
    return static_cast<const char*>(t->storage().data()) + t->storage_offset() * t->itemsize();
  }
  // (Cheaper than Seen::of(t) == *this: no copy, and the dimension is compared first.)
  bool matches(const c10::TensorImpl* t, int64_t dims) const {
    return t->dim() == dims && t->is_contiguous() && t->dtype() == dtype &&
           t->size(0) == size0 && (dims == 1 || t->size(1) == size1) && address(t) == data &&
           t->device() == device;
  }
};

// Bound as transformer_fp8._C.DelayedScalingBatch. Its calls come from Python, the GIL held:
// one at a time.
class DelayedScalingBatch {
 public:
  DelayedScalingBatch(std::vector<at::Tensor> amax_histories, std::vector<at::Tensor> scales,
                      std::vector<at::Tensor> scale_invs, std::vector<double> fp8_maxes)
      : histories_(std::move(amax_histories)), scales_(std::move(scales)),
        scale_invs_(std::move(scale_invs)), fp8_maxes_(std::move(fp8_maxes)) {
    check();
  }

  // update_delayed_scaling(histories, scales, scale_invs, fp8_maxes, margin, amax_compute_algo)
  void update(int64_t margin, const std::string& amax_compute_algo) {
    RECORD_FUNCTION("transformer_fp8::DelayedScalingBatch.update", std::vector<c10::IValue>());
    check_margin(margin);
    const AmaxAlgo algo = parse_amax_algo(amax_compute_algo);
    if (!unchanged()) check();
    const c10::Device device = histories_[0].device();
    const UpdateRunner runner = update_runner(device.type());
    TORCH_CHECK(runner != nullptr, "transformer_fp8: update_delayed_scaling has no kernel for ",
                device, " in this build");
    runner(tensors_.data(), tensors_.size(), static_cast<int>(margin), algo, device);
    // As the operator's Tensor(a!) schema would: the tensors were written in place.
    for (const auto* list : {&histories_, &scales_, &scale_invs_})
      for (const at::Tensor& t : *list) t.unsafeGetTensorImpl()->bump_version();
  }

  int64_t size() const { return static_cast<int64_t>(histories_.size()); }

 private:
  // Checks everything; only then replaces what update() reads (a refusal changes nothing).
  void check() {
    check_delayed_scaling_args(histories_, scales_, scale_invs_, fp8_maxes_, 0);
    std::vector<UpdateTensor> tensors = update_tensors(histories_, scales_, scale_invs_,
                                                       fp8_maxes_);
    std::vector<Seen> seen;
    seen.reserve(3 * histories_.size());
    for (const auto* list : {&histories_, &scales_, &scale_invs_})
      for (const at::Tensor& t : *list) seen.push_back(Seen::of(t.unsafeGetTensorImpl()));
    tensors_.swap(tensors);
    seen_.swap(seen);
  }

  bool unchanged() const {
    const size_t count = histories_.size();
    for (size_t i = 0; i < count; ++i) {
      if (!seen_[i].matches(histories_[i].unsafeGetTensorImpl(), 2) ||
          !seen_[count + i].matches(scales_[i].unsafeGetTensorImpl(), 1) ||
          !seen_[2 * count + i].matches(scale_invs_[i].unsafeGetTensorImpl(), 1))
        return false;
    }
    return true;
  }

  std::vector<at::Tensor> histories_, scales_, scale_invs_;
  std::vector<double> fp8_maxes_;
  std::vector<UpdateTensor> tensors_;  // the raw pointers the runner reads, made by check()
  std::vector<Seen> seen_;
};

}  // namespace

void bind_delayed_scaling_batch(pybind11::module_& module) {
  namespace py = pybind11;
  py::class_<DelayedScalingBatch, std::shared_ptr<DelayedScalingBatch>>(
      module, "DelayedScalingBatch",
      "DelayedScalingBatch(amax_histories, scales, scale_invs, fp8_maxes): the tensors of one "
      "delayed-scaling update, checked as update_delayed_scaling checks them; "
      ".update(margin, amax_compute_algo) then does what update_delayed_scaling does with them.")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<double>>(),
           py::arg("amax_histories"), py::arg("scales"), py::arg("scale_invs"),
           py::arg("fp8_maxes"))
      .def("update", &DelayedScalingBatch::update, py::arg("margin"),
           py::arg("amax_compute_algo"))
      .def("__len__", &DelayedScalingBatch::size);
}

}  // namespace transformer_fp8
