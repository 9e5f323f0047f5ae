// The route policy in C++; see route_policy.h. Each function names the Python it follows, and keeps
// its arithmetic: the same integers, and the same double operations in the same order.
#include "route_policy.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace pkv {
namespace {

// An integer field of the flat array: finite, whole, within [low, high].
bool read_int(const double* values, int64_t index, int64_t low, int64_t high, int64_t* out) {
  const double v = values[index];
  if (!std::isfinite(v) || v != std::floor(v) || v < static_cast<double>(low) || v > static_cast<double>(high)) {
    return false;
  }
  *out = static_cast<int64_t>(v);
  return true;
}

constexpr int64_t kMaxInt = (int64_t{1} << 31) - 1;
constexpr int64_t kMaxBucketTilesPerSplit = 1024;  // pkv/config/schema.py: BUCKET_TILES

// choose.py: is_skewed.
bool is_skewed(int64_t batch, int64_t longest, int64_t tokens) { return batch > 1 && 3 * longest > 2 * tokens; }

// choose.py: OVER_SPLIT_TILES and is_over_split.
constexpr int64_t kOverSplitTiles = 2;
bool is_over_split(int64_t batch, int64_t tokens, int64_t num_splits) {
  return batch > 1 && tokens < kOverSplitTiles * kTileTokens * num_splits * batch;
}

// choose.py: UNIFORM_LENGTH_FRACTION, UNIFORM_CTA_TOLERANCE and uniform_split_count.
constexpr double kUniformLengthFraction = 0.9;
constexpr double kUniformCtaTolerance = 1.5;
int64_t uniform_split_count(const int32_t* lens, int64_t batch, int64_t longest, int64_t num_kv_heads,
                            int64_t num_splits, int64_t target_ctas) {
  const int64_t pairs = batch * num_kv_heads;
  const int64_t capped = std::max<int64_t>(1, (2 * target_ctas + pairs) / (2 * pairs));
  const double ctas = static_cast<double>(capped * pairs), target = static_cast<double>(target_ctas);
  if (capped >= num_splits || !(target / kUniformCtaTolerance <= ctas && ctas <= target * kUniformCtaTolerance)) {
    return num_splits;
  }
  const int64_t shortest = *std::min_element(lens, lens + batch);
  return static_cast<double>(shortest) >= kUniformLengthFraction * static_cast<double>(longest) ? capped : num_splits;
}

// choose.py: bucket_split_count (the largest power of two of splits of at least tiles_per_split tiles).
int64_t bucket_split_count(int64_t longest, int64_t num_splits, int64_t tiles_per_split) {
  if (tiles_per_split <= 1) return num_splits;
  const int64_t fits = row_tiles(longest) / tiles_per_split;
  if (fits >= num_splits) return num_splits;
  int64_t splits = 1;
  while (2 * splits <= fits) splits *= 2;
  return splits;
}

struct RouteCounts {
  int64_t ctas, launches, merged;
};

// estimator.py: Estimator.counts (its scalar and array forms give the same integers).
RouteCounts flashinfer_counts(int64_t batch, const RoutePolicyParams& p) {
  const double ctas = std::ceil(static_cast<double>(batch * p.num_kv_heads) * p.flashinfer_ctas_per_row_head);
  return {std::max<int64_t>(1, static_cast<int64_t>(ctas)), 1, 0};
}

RouteCounts bucket_counts(const int32_t* lens, int64_t batch, int64_t num_splits, int64_t hkv) {
  // One launch per distinct length (and a merge launch where it splits), the estimate of the
  // exact mode whatever mode runs (estimator.py's module note).
  std::vector<int32_t> sorted(lens, lens + batch);
  std::sort(sorted.begin(), sorted.end());
  RouteCounts c{0, 0, 0};
  for (int64_t i = 0; i < batch;) {
    int64_t j = i;
    while (j < batch && sorted[j] == sorted[i]) ++j;
    const int64_t rows = j - i, s = std::min(num_splits, row_tiles(sorted[i]));
    c.ctas += rows * hkv * s;
    c.launches += s > 1 ? 2 : 1;
    if (s > 1) c.merged += rows * hkv * s;
    i = j;
  }
  return c;
}

RouteCounts workqueue_counts(const int32_t* lens, int64_t batch, const SplitPolicyArgs& split, int64_t hkv) {
  const int64_t per_task = workqueue_tiles_per_task(lens, batch, hkv, split);
  int64_t total = 0, merged_rows = 0;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t k = row_split_count(split, row_tiles(lens[i]), per_task);
    total += k;
    if (k > 1) merged_rows += k;
  }
  return {hkv * total, merged_rows ? 2 : 1, hkv * merged_rows};
}

// estimator.py: Estimator.total_us, host planning included.
double total_us(const RouteCounts& c, int64_t tokens, double plan_us, const RoutePolicyParams& p) {
  const double occupancy = std::max(1.0, p.occupancy_ctas / static_cast<double>(c.ctas));
  return static_cast<double>(tokens) * p.us_per_token * occupancy + static_cast<double>(c.launches) * p.lambda_us +
         static_cast<double>(c.merged) * p.us_per_slot + plan_us;
}

}  // namespace

bool parse_route_policy(const double* values, int64_t count, RoutePolicyParams* out, const char** error,
                        int64_t* bad_index) {
  auto fail = [&](int64_t index, const char* what) {
    *error = what;
    *bad_index = index;
    return false;
  };
  if (count != kPolicyValues) return fail(-1, "the policy array has the wrong length");
  int64_t version = 0, flag = 0;
  if (!read_int(values, 0, kPolicyVersion, kPolicyVersion, &version)) return fail(0, "unknown policy version");
  if (!read_int(values, 1, 0, 1, &flag)) return fail(1, "group_supported must be 0 or 1");
  out->group_supported = flag;
  if (!read_int(values, 2, 0, 1, &flag)) return fail(2, "exact_buckets must be 0 or 1");
  out->exact_buckets = flag;
  if (!read_int(values, 3, 1, kMaxInt, &out->num_kv_heads)) return fail(3, "num_kv_heads must be in 1..2^31-1");
  double* reals[] = {&out->us_per_token, &out->us_per_slot, &out->occupancy_ctas, &out->lambda_us,
                     &out->flashinfer_ctas_per_row_head, &out->flashinfer_plan_us, &out->persistentkv_plan_us};
  for (int64_t i = 0; i < 7; ++i) {
    const double v = values[4 + i];
    if (!std::isfinite(v) || v < 0) return fail(4 + i, "cost constants must be finite and >= 0");
    *reals[i] = v;
  }
  for (int r = 0; r < kNumRegimes; ++r) {
    const int64_t base = kPolicyHeader + r * kPolicyRegimeFields;
    RegimePolicy& regime = out->regimes[r];
    int64_t route = 0, balanced = 0, skew = 0, over = 0;
    if (!read_int(values, base, 0, kMaxInt, &regime.min_context_tokens)) {
      return fail(base, "min_context_tokens must be in 0..2^31-1");
    }
    if (!read_int(values, base + 1, kRouteFlashInfer, kRouteBuckets, &route)) {
      return fail(base + 1, "the candidate route code must be -1, 0 or 1");
    }
    regime.has_candidate = route != kRouteFlashInfer;
    regime.candidate.route = route;
    SplitPolicyArgs& split = regime.candidate.split;
    if (!read_int(values, base + 2, 1, kMaxMergeSlots, &split.num_splits)) {
      return fail(base + 2, "num_splits must be in 1..1024");
    }
    if (!read_int(values, base + 3, 0, 1, &balanced)) return fail(base + 3, "balanced must be 0 or 1");
    split.balanced = balanced;
    if (!read_int(values, base + 4, 0, kMaxInt, &split.target_ctas)) {
      return fail(base + 4, "target_ctas must be in 0..2^31-1");
    }
    if (!read_int(values, base + 5, 1, kMaxMergeSlots, &split.max_splits)) {
      return fail(base + 5, "max_splits must be in 1..1024");
    }
    if (!read_int(values, base + 6, 1, kMaxInt, &split.min_tiles_per_split)) {
      return fail(base + 6, "min_tiles_per_split must be in 1..2^31-1");
    }
    regime.margin = values[base + 7];
    if (!std::isfinite(regime.margin) || regime.margin <= 0) return fail(base + 7, "margin must be finite and > 0");
    if (!read_int(values, base + 8, 0, kMaxInt, &regime.uniform_target_ctas)) {
      return fail(base + 8, "uniform_target_ctas must be in 0..2^31-1");
    }
    if (!read_int(values, base + 9, 0, kMaxInt, &skew)) return fail(base + 9, "skew_target_ctas must be in 0..2^31-1");
    if (!read_int(values, base + 10, 0, 1, &over)) return fail(base + 10, "over_split_balanced must be 0 or 1");
    if (!read_int(values, base + 11, 1, kMaxBucketTilesPerSplit, &regime.bucket_tiles_per_split)) {
      return fail(base + 11, "bucket_tiles_per_split must be in 1..1024");
    }
    regime.has_skew_route = skew > 0;
    regime.skew_route = regime.candidate;
    regime.skew_route.split.balanced = true;
    regime.skew_route.split.target_ctas = skew;
    regime.over_split_balanced = over;
  }
  return true;
}

// choose.py: RoutePolicy.choose.
RouteChoice choose_route(const int32_t* seq_lens, int64_t batch, const RoutePolicyParams& p) {
  RouteChoice choice{RouteBasis::kGateGroup, kRouteFlashInfer, PolicyRoute{kRouteFlashInfer, {false, 0, 0, 0, 1}},
                     0, 0, 0, 0};
  if (!p.group_supported) return choice;
  int64_t longest = 0, tokens = 0;
  for (int64_t i = 0; i < batch; ++i) {
    longest = std::max<int64_t>(longest, seq_lens[i]);
    tokens += seq_lens[i];
  }
  const RegimePolicy& regime = p.regimes[batch <= 1 ? 0 : (batch < kManyRowsFrom ? 1 : 2)];
  if (longest < regime.min_context_tokens) {
    choice.basis = RouteBasis::kGateContext;
    return choice;
  }
  if (!regime.has_candidate) {
    choice.basis = RouteBasis::kGateRegime;
    return choice;
  }
  PolicyRoute& candidate = choice.candidate;
  candidate = regime.candidate;
  if (regime.has_skew_route && (is_skewed(batch, longest, tokens) ||
                                (regime.over_split_balanced && is_over_split(batch, tokens, candidate.split.num_splits)))) {
    candidate = regime.skew_route;
  } else if (regime.uniform_target_ctas) {
    candidate.split.num_splits = uniform_split_count(seq_lens, batch, longest, p.num_kv_heads,
                                                     candidate.split.num_splits, regime.uniform_target_ctas);
  } else if (candidate.route == kRouteBuckets) {
    candidate.split.num_splits = bucket_split_count(longest, candidate.split.num_splits,
                                                    regime.bucket_tiles_per_split);
  }
  const RouteCounts counts = candidate.route == kRouteBuckets
                                 ? bucket_counts(seq_lens, batch, candidate.split.num_splits, p.num_kv_heads)
                                 : workqueue_counts(seq_lens, batch, candidate.split, p.num_kv_heads);
  if (counts.ctas == 0) {  // no row has a token: nothing to estimate (Python divides by zero)
    choice.basis = RouteBasis::kNoTokens;
    return choice;
  }
  choice.basis = RouteBasis::kEstimate;
  choice.flashinfer_us = total_us(flashinfer_counts(batch, p), tokens, p.flashinfer_plan_us, p);
  choice.candidate_us = total_us(counts, tokens, p.persistentkv_plan_us, p);
  choice.speedup = choice.flashinfer_us / choice.candidate_us;
  choice.margin = regime.margin;
  if (choice.speedup >= regime.margin) choice.route = candidate.route;
  return choice;
}

}  // namespace pkv
