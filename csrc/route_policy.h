// The route policy of a decode step in C++: pkv/policy/choose.py's RoutePolicy.choose and the cost
// of pkv/policy/estimator.py's Estimator.total_us, so that an eager step decides its route, plans
// and packs it in one call (host_ops.cpp, adaptive_plan) instead of a Python policy and two op
// calls. The Python policy stays the specification: tests hold this one to it decision for
// decision, estimate for estimate, on synthetic and recorded steps (tests/test_native_policy.py).
//
// The policy reaches C++ as a flat array of doubles that pkv/policy/native.py writes once per
// policy (every value is an integer below 2^53 or the double Python computes with, so the
// estimates here are the same floating-point operations in the same order as Python's).
// Framework-free: plain pointers and sizes.
#pragma once
#include <cstdint>

#include "split_rule.h"
#include "step_plan.h"

namespace pkv {

// The route code of a step left to FlashInfer (the PersistentKV routes are PlanRoute's codes).
constexpr int64_t kRouteFlashInfer = -1;

// What decided a step's route; the order of pkv/policy/native.py's BASES.
enum class RouteBasis : int64_t { kGateGroup = 0, kGateContext = 1, kGateRegime = 2, kEstimate = 3, kNoTokens = 4 };

// A PersistentKV route the policy may estimate: the planner's route code and its split rule (the
// bucket route reads num_splits only).
struct PolicyRoute {
  int64_t route;
  SplitPolicyArgs split;
};

// One regime's resolved parameters (RoutePolicy._regimes in pkv/policy/choose.py).
struct RegimePolicy {
  int64_t min_context_tokens;
  bool has_candidate;  // false: the regime stays on FlashInfer
  PolicyRoute candidate;
  double margin;
  int64_t uniform_target_ctas;  // the uniform cap's CTA target; 0: no cap
  bool has_skew_route;          // skewed (and, with over_split_balanced, over-split) steps take skew_route
  PolicyRoute skew_route;
  bool over_split_balanced;
  int64_t bucket_tiles_per_split;  // the short-row rule of a bucket candidate; 1: the split count as it is
};

constexpr int kNumRegimes = 3;  // single_row (B1), few_rows (2..7), many_rows (8+)
constexpr int64_t kManyRowsFrom = 8;

struct RoutePolicyParams {
  bool group_supported;
  bool exact_buckets;  // the bucket route's mode: one launch per distinct length, or one masked launch
  int64_t num_kv_heads;
  double us_per_token, us_per_slot, occupancy_ctas, lambda_us;
  double flashinfer_ctas_per_row_head, flashinfer_plan_us, persistentkv_plan_us;
  RegimePolicy regimes[kNumRegimes];
};

// The flat layout (pkv/policy/native.py writes it): kPolicyHeader values, then kPolicyRegimeFields
// per regime in the order single_row, few_rows, many_rows.
constexpr int64_t kPolicyVersion = 2;
constexpr int64_t kPolicyHeader = 11;
constexpr int64_t kPolicyRegimeFields = 12;
constexpr int64_t kPolicyValues = kPolicyHeader + kNumRegimes * kPolicyRegimeFields;

// Reads the flat array into `out`; on a malformed array returns false with `error` naming the
// value at fault (the index into the array is written to `bad_index`).
bool parse_route_policy(const double* values, int64_t count, RoutePolicyParams* out, const char** error,
                        int64_t* bad_index);

struct RouteChoice {
  RouteBasis basis;
  int64_t route;          // the route taken: kRouteFlashInfer, kRouteWorkqueue or kRouteBuckets
  PolicyRoute candidate;  // the PersistentKV route estimated (taken where route is not FlashInfer)
  double flashinfer_us, candidate_us, speedup, margin;  // 0 where a gate decided
};

// RoutePolicy.choose on `batch` >= 1 rows of these lengths (each >= 0).
RouteChoice choose_route(const int32_t* seq_lens, int64_t batch, const RoutePolicyParams& policy);

}  // namespace pkv
