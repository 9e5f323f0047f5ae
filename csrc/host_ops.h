// The eager step's host work as a function the CUDA binding also calls (host_ops.cpp defines it
// and registers it as torch.ops.pkv.adaptive_plan): the route policy decides and, where it picks a
// PersistentKV route, the step is planned, packed and (with upload_to) uploaded.
#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

namespace pkv_host {

// (choice ints, estimates, packed host plan or none, the plan on upload_to's device or none, layout);
// route_policy.h and step_plan.h say what each holds. A step left to FlashInfer has no plan.
using AdaptivePlan = std::tuple<std::vector<int64_t>, std::vector<double>, std::optional<at::Tensor>,
                                std::optional<at::Tensor>, std::vector<int64_t>>;

AdaptivePlan adaptive_plan(const at::Tensor& seq_lens, const at::Tensor& pages,
                           const std::optional<at::Tensor>& page_indptr, const at::Tensor& policy, bool pinned,
                           std::optional<at::Device> upload_to);

}  // namespace pkv_host
