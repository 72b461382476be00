// The top-k / top-p / min-p set of one sampling distribution, as decoding.logits_to_probs keeps it:
// the heaviest columns (ties by column) up to the k-th, up to the first whose mass before it passes
// top_p of the whole distribution, and down to min_p of the heaviest weight (so the heaviest always
// stays). Shared by the draft walk and the target's sampling kernel.
//
// Only the heaviest columns are sorted: those with at least `floor` of the largest weight (weights
// are exp((s - max) / T), so the largest is 1), the floor lowered until the set ends among them,
// since every column below the floor is lighter than every column above it. A language model's
// nucleus usually ends within the first floor (1e-3): a few dozen columns sorted, not 49,152.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

using Weighted = std::pair<float, int64_t>;  // (weight, column)

// Whether top-k / top-p / min-p cut anything from a distribution over `cols` columns.
inline bool cuts(int64_t cols, int64_t top_k, float top_p, float min_p) {
  return (top_k > 0 && top_k < cols) || top_p < 1.0f || min_p > 0.0f;
}

// Fills `heavy` with the kept set, heaviest first; returns false for a distribution without top-k,
// top-p or min-p (every column kept, `heavy` untouched). `collect(floor, heavy)` appends every
// column whose weight is positive and at least `floor`; `total` is the sum of all weights, and the
// heaviest weight is 1 (weights are exp((s - max) / T)), so min-p keeps the weights >= min_p.
template <typename Collect>
bool nucleus(int64_t cols, int64_t top_k, float top_p, float min_p, double total, std::vector<Weighted>& heavy,
             Collect collect) {
  if (!cuts(cols, top_k, top_p, min_p)) return false;
  const bool use_k = top_k > 0 && top_k < cols, use_p = top_p < 1.0f;
  const int64_t rank_limit = use_k ? top_k : cols;
  const double mass_limit = use_p ? static_cast<double>(top_p) * total : INFINITY;
  for (float floor = 1e-3f;; floor = floor > 1e-9f ? floor * 1e-3f : 0.0f) {
    heavy.clear();
    collect(floor, heavy);
    std::sort(heavy.begin(), heavy.end(), [](const Weighted& a, const Weighted& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    const int64_t candidates = static_cast<int64_t>(heavy.size());
    double before = 0.0;
    int64_t kept = 0;
    for (; kept < candidates && kept < rank_limit && before <= mass_limit && heavy[kept].first >= min_p; ++kept)
      before += heavy[kept].first;
    // the set ends here, or every column it could still reach (weight >= min_p) is a candidate
    if (kept < candidates || kept >= rank_limit || floor == 0.0f || floor <= min_p) {
      heavy.resize(kept);
      return true;
    }
  }
}
