// The target's temperature-only sampling distributions of verify rows, never materialised.
//
// For a row of float32 logits l and inverse temperature s: e_j = exp((l_j - m) s) with m = max l
// (0 where l_j = -inf or the exponent is below -87), Z = the sum of e, p_j = e_j * (1 / Z). Every
// function computes e_j with the same 16-lane code, so the probability read for acceptance is the
// one the sampler draws from. Z sums each 16-column chunk in a fixed order (float32), then the
// chunks in order (float64); sampling walks the same chunk sums to the chunk holding u * Z and then
// that chunk's columns in order (the last column with mass if rounding leaves u * Z past them).
#include <stdint.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "simd_math.h"
#include "simd16.h"

namespace {

constexpr int kLanes = 16;

// e of the chunk starting at `start` (lanes past the row are 0).
inline vec16 chunk_e(const float* row, int64_t cols, int64_t start, float max, float scale) {
  const lanemask mask = first_lanes(cols - start);
  const vec16 logits = vload_masked(mask, row + start);
  const vec16 x = vmul(vsub(logits, vset1(max)), vset1(scale));
  const lanemask live = mask & vge(x, vset1(-87.0f));
  return vselect(live, exp_nonpositive(x), vzero());
}

double row_total(const float* row, int64_t cols, float max, float scale) {
  double total = 0.0;
  for (int64_t j = 0; j < cols; j += kLanes) total += vreduce_add(chunk_e(row, cols, j, max, scale));
  return total;
}

// The column where the running sum of `values` (one chunk at a time, from `chunk_sum`) passes
// `target`: the inverse CDF. `values(j)` gives the chunk at j as 16 lanes.
template <typename Chunk>
int64_t inverse_cdf(int64_t cols, double target, Chunk values) {
  double before = 0.0;
  int64_t last_with_mass = 0;
  for (int64_t j = 0; j < cols; j += kLanes) {
    const vec16 chunk = values(j);
    const double sum = vreduce_add(chunk);
    if (sum > 0.0) {
      alignas(64) float lanes[kLanes];
      vstore(lanes, chunk);
      if (before + sum > target) {
        double running = before;
        for (int i = 0; i < kLanes && j + i < cols; ++i) {
          running += lanes[i];
          if (lanes[i] > 0.0f) last_with_mass = j + i;
          if (running > target) return j + i;
        }
        return last_with_mass;  // rounding: the lanes summed in order fell short of the chunk sum
      }
      for (int i = kLanes - 1; i >= 0; --i)
        if (lanes[i] > 0.0f && j + i < cols) {
          last_with_mass = j + i;
          break;
        }
    }
    before += sum;
  }
  return last_with_mass;
}

}  // namespace

extern "C" {

// Per row i of `rows` (indices into logits [*, cols] with row stride `stride`): its max and Z.
void dspark_softmax_rows(const float* logits, int64_t stride, int64_t cols, const int64_t* rows, int64_t n,
                         const float* scale, float* maxima, double* totals, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (n * cols >= (int64_t(1) << 18))
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits + rows[i] * stride;
    maxima[i] = max_of(row, cols);
    totals[i] = row_total(row, cols, maxima[i], scale[i]);
  }
}

// p_j of column columns[k] in the row of prepared row at[k] (an index into the prepared rows).
void dspark_softmax_at(const float* logits, int64_t stride, int64_t cols, const int64_t* rows, const float* scale,
                       const float* maxima, const double* totals, const int64_t* at, const int64_t* columns,
                       int64_t n, float* out) {
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = at[k], column = columns[k];
    const int64_t start = column - column % kLanes;
    alignas(64) float lanes[kLanes];
    vstore(lanes, chunk_e(logits + rows[i] * stride, cols, start, maxima[i], scale[i]));
    out[k] = lanes[column - start] * static_cast<float>(1.0 / totals[i]);
  }
}

// One token per prepared row at[k], from p (u: uniforms in [0, 1)).
void dspark_sample_softmax(const float* logits, int64_t stride, int64_t cols, const int64_t* rows, const float* scale,
                           const float* maxima, const double* totals, const int64_t* at, const double* uniforms,
                           int64_t n, int64_t* out) {
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = at[k];
    const float* row = logits + rows[i] * stride;
    out[k] = inverse_cdf(cols, uniforms[k] * totals[i],
                         [&](int64_t j) { return chunk_e(row, cols, j, maxima[i], scale[i]); });
  }
}

// One token per prepared row at[k] from the residual norm(max(0, p - q_k)), q_k the draft's
// distribution: draft_values[k, :] at the sorted target columns draft_columns (zero elsewhere).
// Where the residual has no mass above `eps` (only rounding can do that), from p.
void dspark_sample_residual(const float* logits, int64_t stride, int64_t cols, const int64_t* rows, const float* scale,
                            const float* maxima, const double* totals, const int64_t* at, const double* uniforms,
                            int64_t n, const int64_t* draft_columns, int64_t draft_count, const float* draft_values,
                            int64_t draft_stride, double eps, int64_t* out) {
  std::vector<float> draft(cols + kLanes, 0.0f);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = at[k];
    const float* row = logits + rows[i] * stride;
    const float inverse_total = static_cast<float>(1.0 / totals[i]);
    for (int64_t d = 0; d < draft_count; ++d) draft[draft_columns[d]] = draft_values[k * draft_stride + d];
    auto residual = [&](int64_t j) {
      const vec16 p = vmul(chunk_e(row, cols, j, maxima[i], scale[i]), vset1(inverse_total));
      const vec16 q = vload_masked(first_lanes(cols - j), draft.data() + j);
      return vmax(vsub(p, q), vzero());
    };
    double mass = 0.0;
    for (int64_t j = 0; j < cols; j += kLanes) mass += vreduce_add(residual(j));
    if (mass > eps) {
      out[k] = inverse_cdf(cols, uniforms[k] * mass, residual);
    } else {
      out[k] = inverse_cdf(cols, uniforms[k] * totals[i],
                           [&](int64_t j) { return chunk_e(row, cols, j, maxima[i], scale[i]); });
    }
    for (int64_t d = 0; d < draft_count; ++d) draft[draft_columns[d]] = 0.0f;
  }
}
}
