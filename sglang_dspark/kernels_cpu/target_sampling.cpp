// The target's sampling distributions of verify rows (temperature, top-k, top-p, min-p), never
// materialised.
//
// For a row of float32 logits l and inverse temperature s: e_j = exp((l_j - m) s) with m = max l
// (0 where l_j = -inf or the exponent is below -87), kept only inside the row's top-k / top-p set
// / min-p (nucleus.h), Z = the sum of the kept e, p_j = e_j * (1 / Z). Each row stores its set as a cut:
// column j is kept iff e_j > cut or (e_j == cut and j <= tie_column), the lightest kept column
// being (cut, tie_column) since ties go by column (cut -1 for a row without any of them). Every function
// computes e_j with the same 16-lane code, so the probability read for acceptance is the one the
// sampler draws from. Z sums each 16-column chunk in a fixed order (float32), then the chunks in
// order (float64); sampling walks the same chunk sums to the chunk holding u * Z and then that
// chunk's columns in order (the last column with mass if rounding leaves u * Z past them).
#include <stdint.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "nucleus.h"
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

// A row's kept set (see the top of the file).
struct Cut {
  float weight;  // columns heavier than this are kept; -1: every column
  int64_t tie_column;  // of the columns exactly this heavy, those up to here are kept
};

// chunk_e with the columns outside the row's kept set zeroed.
inline vec16 chunk_kept(const float* row, int64_t cols, int64_t start, float max, float scale, Cut cut) {
  const vec16 e = chunk_e(row, cols, start, max, scale);
  const vec16 weight = vset1(cut.weight);
  const lanemask heavier = vgt(e, weight), tied = vge(e, weight) & ~heavier;
  return vselect(heavier | (tied & first_lanes(cut.tie_column - start + 1)), e, vzero());
}

double kept_total(const float* row, int64_t cols, float max, float scale, Cut cut) {
  double total = 0.0;
  for (int64_t j = 0; j < cols; j += kLanes) total += vreduce_add(chunk_kept(row, cols, j, max, scale, cut));
  return total;
}

// The row's top-k / top-p / min-p cut (nucleus.h), or Cut{-1} without any of them.
Cut nucleus_cut(const float* row, int64_t cols, float max, float scale, int64_t top_k, float top_p, float min_p,
                std::vector<Weighted>& heavy) {
  if (!cuts(cols, top_k, top_p, min_p)) return Cut{-1.0f, cols};  // (no pass for a total it would not use)
  const double total = kept_total(row, cols, max, scale, Cut{-1.0f, cols});
  nucleus(cols, top_k, top_p, min_p, total, heavy, [&](float floor, std::vector<Weighted>& found) {
    alignas(64) float lanes[kLanes];
    for (int64_t j = 0; j < cols; j += kLanes) {
      const vec16 e = chunk_e(row, cols, j, max, scale);
      if ((vge(e, vset1(floor)) & vgt(e, vzero())) == 0) continue;
      vstore(lanes, e);
      for (int i = 0; i < kLanes && j + i < cols; ++i)
        if (lanes[i] > 0.0f && lanes[i] >= floor) found.emplace_back(lanes[i], j + i);
    }
  });
  return heavy.empty() ? Cut{-1.0f, cols} : Cut{heavy.back().first, heavy.back().second};
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

// Per row i of `rows` (indices into logits [*, cols] with row stride `stride`): its max, its cut
// (top_k[i] 0, top_p[i] 1 and min_p[i] 0: none) and Z.
void dspark_softmax_rows(const float* logits, int64_t stride, int64_t cols, const int64_t* rows, int64_t n,
                         const float* scale, const int64_t* top_k, const float* top_p, const float* min_p,
                         float* maxima,
                         float* cut_weights, int64_t* tie_columns, double* totals, int threads) {
#pragma omp parallel num_threads(threads) if (n * cols >= (int64_t(1) << 18))
  {
    std::vector<Weighted> heavy;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float* row = logits + rows[i] * stride;
      maxima[i] = max_of(row, cols);
      const Cut cut = nucleus_cut(row, cols, maxima[i], scale[i], top_k[i], top_p[i], min_p[i], heavy);
      cut_weights[i] = cut.weight;
      tie_columns[i] = cut.tie_column;
      totals[i] = kept_total(row, cols, maxima[i], scale[i], cut);
    }
  }
}

// p_j of column columns[k] in the row of prepared row at[k] (an index into the prepared rows).
void dspark_softmax_at(const float* logits, int64_t stride, int64_t cols, const int64_t* rows, const float* scale,
                       const float* maxima, const float* cut_weights, const int64_t* tie_columns,
                       const double* totals, const int64_t* at, const int64_t* columns,
                       int64_t n, float* out) {
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = at[k], column = columns[k];
    const int64_t start = column - column % kLanes;
    alignas(64) float lanes[kLanes];
    vstore(lanes, chunk_kept(logits + rows[i] * stride, cols, start, maxima[i], scale[i],
                             Cut{cut_weights[i], tie_columns[i]}));
    out[k] = lanes[column - start] * static_cast<float>(1.0 / totals[i]);
  }
}

// One token per prepared row at[k], from p (u: uniforms in [0, 1)).
void dspark_sample_softmax(const float* logits, int64_t stride, int64_t cols, const int64_t* rows, const float* scale,
                           const float* maxima, const float* cut_weights, const int64_t* tie_columns,
                           const double* totals, const int64_t* at, const double* uniforms,
                           int64_t n, int64_t* out) {
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = at[k];
    const float* row = logits + rows[i] * stride;
    const Cut cut{cut_weights[i], tie_columns[i]};
    out[k] = inverse_cdf(cols, uniforms[k] * totals[i],
                         [&](int64_t j) { return chunk_kept(row, cols, j, maxima[i], scale[i], cut); });
  }
}

// One token per prepared row at[k] from the residual norm(max(0, p - q_k)), q_k the draft's
// distribution: draft_values[k, :] at the sorted target columns draft_columns (zero elsewhere).
// Where the residual has no mass above `eps` (only rounding can do that), from p.
void dspark_sample_residual(const float* logits, int64_t stride, int64_t cols, const int64_t* rows, const float* scale,
                            const float* maxima, const float* cut_weights, const int64_t* tie_columns,
                            const double* totals, const int64_t* at, const double* uniforms,
                            int64_t n, const int64_t* draft_columns, int64_t draft_count, const float* draft_values,
                            int64_t draft_stride, double eps, int64_t* out) {
  std::vector<float> draft(cols + kLanes, 0.0f);
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = at[k];
    const float* row = logits + rows[i] * stride;
    const float inverse_total = static_cast<float>(1.0 / totals[i]);
    const Cut cut{cut_weights[i], tie_columns[i]};
    for (int64_t d = 0; d < draft_count; ++d) draft[draft_columns[d]] = draft_values[k * draft_stride + d];
    auto residual = [&](int64_t j) {
      const vec16 p = vmul(chunk_kept(row, cols, j, maxima[i], scale[i], cut), vset1(inverse_total));
      const vec16 q = vload_masked(first_lanes(cols - j), draft.data() + j);
      return vmax(vsub(p, q), vzero());
    };
    double mass = 0.0;
    for (int64_t j = 0; j < cols; j += kLanes) mass += vreduce_add(residual(j));
    if (mass > eps) {
      out[k] = inverse_cdf(cols, uniforms[k] * mass, residual);
    } else {
      out[k] = inverse_cdf(cols, uniforms[k] * totals[i],
                           [&](int64_t j) { return chunk_kept(row, cols, j, maxima[i], scale[i], cut); });
    }
    for (int64_t d = 0; d < draft_count; ++d) draft[draft_columns[d]] = 0.0f;
  }
}
}
