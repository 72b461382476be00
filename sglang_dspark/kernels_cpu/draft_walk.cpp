// The greedy Markov walk over a drafted block, in one call (see draft_walk.py).
//
// For each request b and slot k = 0..W-1, with prev_0 = the anchor:
//   e      = W1[prev_k]                                   (the vanilla Markov head's embedding)
//   conf_k = proj . [h_k ; e] + proj_bias                 (the confidence head, when there is one)
//   x_k    = argmax_j base[b, k, j] + (W2 e)_j            (W2 e: the Markov bias; 0 without a head)
//   prev_{k+1} = d2t[x_k]                                 (draft id -> target id)
// which is what decoding.sample_block computes for greedy rows with ~12 torch ops a slot. The sums
// are float32; where the drafter is bfloat16 the bias and the confidence are rounded to bfloat16
// once, as torch's bfloat16 linear rounds its output, so the drafts are torch's.
//
// The sampled walk draws x_k from softmax(scores * scale) instead (scale = 1 / temperature, one
// uniform per slot, an inverse CDF over 16-column chunks), restricted to the row's top-k / top-p
// set as decoding.logits_to_probs restricts it, and writes that distribution, which rejection
// sampling needs as p_d. A row with scale 0 is greedy inside a sampled batch: its argmax, and a
// one-hot distribution on it.
//
// dspark_grow_tree grows one request's best-first tree of drafts (decoding/tree.py's grow_tree:
// the same nodes, listed best first instead of level by level): it expands the most probable
// candidate each time, scoring its children with the same slot scores as the walk, so a tree of
// n nodes costs n + 1 slot scorings.
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "nucleus.h"
#include "simd_math.h"
#include "simd16.h"

namespace {

struct Walk {
  const void* base;
  int64_t base_row_stride, base_slot_stride;
  const void* hidden;
  int64_t hidden_row_stride, hidden_slot_stride, hidden_size;
  const int64_t* anchors;
  const void* w1;  // [vocab, rank] contiguous, or null (no Markov head)
  const void* w2;  // [draft_vocab, rank] with strides (w2_vocab_stride, w2_rank_stride)
  int64_t w2_vocab_stride, w2_rank_stride, rank;
  const void* proj;  // confidence head weight [hidden (+ rank)], or null (no confidence head)
  float proj_bias;
  int proj_reads_markov;
  const int64_t* d2t;  // [draft_vocab], or null (full vocabulary)
  int64_t rows, width, draft_vocab;
  int64_t* tokens;  // [rows, width] target ids
  float* confidences;  // [rows, width], or null
  const float* scale;  // sampled walk: 1 / temperature per row (0: a greedy row); null: all greedy
  const int64_t* top_k;  // sampled walk: [rows], 0 = off
  const float* top_p;  // sampled walk: [rows], 1 = off
  const float* min_p;  // sampled walk: [rows], 0 = off
  const double* uniforms;  // sampled walk: [rows, width] in [0, 1)
  float* probs;  // sampled walk: [rows, width, draft_vocab], each draft's distribution
};

// scores[j] = base[b, k, j] + the Markov bias given prev; writes slot k's confidence.
template <typename T>
void slot_scores(const Walk& w, int64_t b, int64_t k, int64_t prev, float* embedding, float* scores, bool bf16) {
  const T* w1 = static_cast<const T*>(w.w1);
  const T* w2 = static_cast<const T*>(w.w2);
  const T* proj = static_cast<const T*>(w.proj);
  if (w1 != nullptr)
    for (int64_t r = 0; r < w.rank; ++r) embedding[r] = load(w1, prev * w.rank + r);
  const T* h = static_cast<const T*>(w.hidden) + b * w.hidden_row_stride + k * w.hidden_slot_stride;
  if (proj != nullptr) {
    float sum = 0.0f;
    for (int64_t i = 0; i < w.hidden_size; ++i) sum += load(h, i) * load(proj, i);
    if (w.proj_reads_markov)
      for (int64_t r = 0; r < w.rank; ++r) sum += embedding[r] * load(proj, w.hidden_size + r);
    sum += w.proj_bias;
    w.confidences[b * w.width + k] = bf16 ? round_bf16(sum) : sum;
  }
  for (int64_t j = 0; j < w.draft_vocab; ++j) scores[j] = 0.0f;
  if (w1 != nullptr) {
    for (int64_t r = 0; r < w.rank; ++r) {
      const float e = embedding[r];
      const T* column = w2 + r * w.w2_rank_stride;
      if (w.w2_vocab_stride == 1) {
        for (int64_t j = 0; j < w.draft_vocab; ++j) scores[j] += load(column, j) * e;
      } else {
        for (int64_t j = 0; j < w.draft_vocab; ++j) scores[j] += load(column, j * w.w2_vocab_stride) * e;
      }
    }
    if (bf16)
      for (int64_t j = 0; j < w.draft_vocab; ++j) scores[j] = round_bf16(scores[j]);
  }
  const T* logits = static_cast<const T*>(w.base) + b * w.base_row_stride + k * w.base_slot_stride;
  for (int64_t j = 0; j < w.draft_vocab; ++j) scores[j] += load(logits, j);
}

// The first maximum (a NaN wins, as in torch).
int64_t argmax_scores(const float* scores, int64_t n) {
  int64_t best = 0;
  for (int64_t j = 1; j < n && !std::isnan(scores[best]); ++j)
    if (scores[j] > scores[best] || std::isnan(scores[j])) best = j;
  return best;
}

// Zeroes the weights e[0, n) outside the top-k / top-p / min-p set (nucleus.h) and returns the sum of
// those kept (`total` without any of them).
double keep_nucleus(float* e, int64_t n, double total, int64_t top_k, float top_p, float min_p,
                    std::vector<Weighted>& kept) {
  const bool cut = nucleus(n, top_k, top_p, min_p, total, kept, [e, n](float floor, std::vector<Weighted>& heavy) {
    for (int64_t j = 0; j < n; ++j)
      if (e[j] > 0.0f && e[j] >= floor) heavy.emplace_back(e[j], j);
  });
  if (!cut) return total;
  std::memset(e, 0, sizeof(float) * n);
  double sum = 0.0;
  for (const auto& [weight, column] : kept) {
    e[column] = weight;
    sum += weight;
  }
  return sum;
}

// A draw from softmax(scores * scale) restricted to the top-k / top-p / min-p set, with uniform u;
// that distribution goes to probs[0, n).
int64_t sample_scores(const float* scores, int64_t n, float scale, int64_t top_k, float top_p, float min_p, double u,
                      float* probs, std::vector<Weighted>& order) {
  const vec16 max = vset1(max_of(scores, n));
  double total = 0.0;  // e_j = exp((s_j - max) scale), 0 below e^-87; chunk sums in a fixed order
  for (int64_t j = 0; j < n; j += 16) {
    const lanemask mask = first_lanes(n - j);
    const vec16 x = vmul(vsub(vload_masked(mask, scores + j), max), vset1(scale));
    const vec16 e = vselect(mask & vge(x, vset1(-87.0f)), exp_nonpositive(x), vzero());
    vstore_masked(probs + j, mask, e);
    total += vreduce_add(e);
  }
  total = keep_nucleus(probs, n, total, top_k, top_p, min_p, order);
  const double target = u * total;
  double before = 0.0;
  int64_t chosen = -1, last_with_mass = 0;
  for (int64_t j = 0; j < n && chosen < 0; j += 16) {
    const vec16 e = vload_masked(first_lanes(n - j), probs + j);
    const double sum = vreduce_add(e);
    if (sum <= 0.0) continue;
    if (before + sum > target) {  // this chunk: its columns in order
      double running = before;
      for (int64_t i = j; i < j + 16 && i < n && chosen < 0; ++i) {
        running += probs[i];
        if (probs[i] > 0.0f) last_with_mass = i;
        if (running > target) chosen = i;
      }
      if (chosen < 0) chosen = last_with_mass;  // rounding: the columns summed in order fell short
    } else {
      for (int64_t i = j; i < j + 16 && i < n; ++i)
        if (probs[i] > 0.0f) last_with_mass = i;
      before += sum;
    }
  }
  if (chosen < 0) chosen = last_with_mass;
  const float inverse = static_cast<float>(1.0 / total);
  for (int64_t j = 0; j < n; ++j) probs[j] *= inverse;
  return chosen;
}

// A greedy row's draft in a sampled walk: the argmax, with a one-hot distribution on it.
int64_t argmax_one_hot(const float* scores, int64_t n, float* probs) {
  const int64_t chosen = argmax_scores(scores, n);
  std::memset(probs, 0, sizeof(float) * n);
  probs[chosen] = 1.0f;
  return chosen;
}

template <typename T>
void walk_row(const Walk& w, int64_t b, float* scores, float* embedding, std::vector<Weighted>& order, bool bf16) {
  int64_t prev = w.anchors[b];
  for (int64_t k = 0; k < w.width; ++k) {
    slot_scores<T>(w, b, k, prev, embedding, scores, bf16);
    const int64_t slot = b * w.width + k;
    float* probs = w.scale == nullptr ? nullptr : w.probs + slot * w.draft_vocab;
    const int64_t chosen = w.scale == nullptr ? argmax_scores(scores, w.draft_vocab)
        : w.scale[b] == 0.0f ? argmax_one_hot(scores, w.draft_vocab, probs)
        : sample_scores(scores, w.draft_vocab, w.scale[b], w.top_k[b], w.top_p[b], w.min_p[b], w.uniforms[slot], probs,
                        order);
    prev = w.d2t != nullptr ? w.d2t[chosen] : chosen;
    w.tokens[slot] = prev;
  }
}

// log(sum_j e^scores[j]), as torch's logsumexp: the maximum, plus the log of the shifted sum.
float log_sum_exp(const float* scores, int64_t n) {
  const float top = max_of(scores, n);
  if (!std::isfinite(top)) return top;
  double total = 0.0;
  for (int64_t j = 0; j < n; j += 16) {
    const lanemask mask = first_lanes(n - j);
    const vec16 x = vsub(vload_masked(mask, scores + j), vset1(top));
    total += vreduce_add(vselect(mask & vge(x, vset1(-87.0f)), exp_nonpositive(x), vzero()));
  }
  return top + static_cast<float>(std::log(total));
}

// The `m` best columns of scores, best first (a tie goes to the lower column); returns how many.
int64_t best_columns(const float* scores, int64_t n, int64_t m, int64_t* columns) {
  int64_t count = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(scores[j]) || (count == m && scores[j] <= scores[columns[count - 1]])) continue;
    int64_t at = count < m ? count++ : m - 1;
    for (; at > 0 && scores[j] > scores[columns[at - 1]]; --at) columns[at] = columns[at - 1];
    columns[at] = j;
  }
  return count;
}

struct TreeCandidate {
  float score;  // the path's summed log-probability
  int64_t depth, parent_row, token;
};

// Row 0 of `w` is the request; its anchor is the bonus token. Writes up to `nodes` nodes (target
// ids, parent rows with 0 the bonus, depths), parents before children; returns how many.
template <typename T>
int64_t grow_tree_row(const Walk& w, int64_t nodes, int64_t children, bool bf16, int64_t* tokens, int64_t* parents,
                      int64_t* depths) {
  std::vector<float> scores(w.draft_vocab), embedding(w.rank > 0 ? w.rank : 1);
  std::vector<int64_t> columns(children);
  std::vector<TreeCandidate> heap;  // best on top; a tie goes to the shallower candidate (a parent before its child)
  const auto worse = [](const TreeCandidate& a, const TreeCandidate& b) {
    return a.score < b.score || (a.score == b.score && a.depth > b.depth);
  };
  const auto expand = [&](int64_t row, int64_t depth, int64_t token, float score) {
    if (depth >= w.width) return;
    slot_scores<T>(w, 0, depth, token, embedding.data(), scores.data(), bf16);
    const float total = log_sum_exp(scores.data(), w.draft_vocab);
    const int64_t found = best_columns(scores.data(), w.draft_vocab, children, columns.data());
    for (int64_t i = 0; i < found; ++i) {
      const int64_t column = columns[i];
      heap.push_back({score + (scores[column] - total), depth + 1, row, w.d2t != nullptr ? w.d2t[column] : column});
      std::push_heap(heap.begin(), heap.end(), worse);
    }
  };
  expand(0, 0, w.anchors[0], 0.0f);
  int64_t count = 0;
  while (count < nodes && !heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    const TreeCandidate best = heap.back();
    heap.pop_back();
    tokens[count] = best.token;
    parents[count] = best.parent_row;
    depths[count] = best.depth;
    ++count;
    expand(count, best.depth, best.token, best.score);
  }
  return count;
}

void run_walk(const Walk& walk, int bf16, int threads) {
  const int64_t work = walk.rows * walk.width * walk.draft_vocab * (walk.rank + 1);
#pragma omp parallel num_threads(threads) if (work >= (int64_t(1) << 20))
  {
    std::vector<float> scores(walk.draft_vocab), embedding(walk.rank > 0 ? walk.rank : 1);
    std::vector<Weighted> order;  // the nucleus's candidate columns (sampled rows with top-k / top-p)
#pragma omp for schedule(static)
    for (int64_t b = 0; b < walk.rows; ++b) {
      if (bf16)
        walk_row<uint16_t>(walk, b, scores.data(), embedding.data(), order, true);
      else
        walk_row<float>(walk, b, scores.data(), embedding.data(), order, false);
    }
  }
}

}  // namespace

extern "C" {

void dspark_greedy_walk(const void* base, int64_t base_row_stride, int64_t base_slot_stride, const void* hidden,
                        int64_t hidden_row_stride, int64_t hidden_slot_stride, int64_t hidden_size,
                        const int64_t* anchors, const void* w1, const void* w2, int64_t w2_vocab_stride,
                        int64_t w2_rank_stride, int64_t rank, const void* proj, float proj_bias,
                        int proj_reads_markov, const int64_t* d2t, int64_t rows, int64_t width,
                        int64_t draft_vocab, int bf16, int64_t* tokens, float* confidences, int threads) {
  run_walk(Walk{base, base_row_stride, base_slot_stride, hidden, hidden_row_stride, hidden_slot_stride, hidden_size,
                anchors, w1, w2, w2_vocab_stride, w2_rank_stride, rank, proj, proj_bias, proj_reads_markov, d2t, rows,
                width, draft_vocab, tokens, confidences, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr},
           bf16, threads);
}

// One request's tree over its block's slot logits base [width, draft_vocab] (slot stride given):
// up to `nodes` nodes, each node's `children` best children offered; returns the node count.
int64_t dspark_grow_tree(const void* base, int64_t base_slot_stride, int64_t width, const int64_t* bonus,
                         const void* w1, const void* w2, int64_t w2_vocab_stride, int64_t w2_rank_stride, int64_t rank,
                         const int64_t* d2t, int64_t draft_vocab, int bf16, int64_t nodes, int64_t children,
                         int64_t* tokens, int64_t* parents, int64_t* depths) {
  const Walk walk{base, 0, base_slot_stride, nullptr, 0, 0, 0, bonus, w1, w2, w2_vocab_stride, w2_rank_stride, rank,
                  nullptr, 0.0f, 0, d2t, 1, width, draft_vocab, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                  nullptr, nullptr};
  if (children < 1 || nodes < 1) return 0;
  return bf16 ? grow_tree_row<uint16_t>(walk, nodes, children, true, tokens, parents, depths)
              : grow_tree_row<float>(walk, nodes, children, false, tokens, parents, depths);
}

// The greedy walk's arguments up to `threads`, then scale [rows] (1 / temperature; 0: greedy), top_k
// [rows] (0: off), top_p [rows] (1: off), min_p [rows] (0: off), uniforms [rows, width] and probs
// [rows, width, draft_vocab] (out).
void dspark_sampled_walk(const void* base, int64_t base_row_stride, int64_t base_slot_stride, const void* hidden,
                         int64_t hidden_row_stride, int64_t hidden_slot_stride, int64_t hidden_size,
                         const int64_t* anchors, const void* w1, const void* w2, int64_t w2_vocab_stride,
                         int64_t w2_rank_stride, int64_t rank, const void* proj, float proj_bias,
                         int proj_reads_markov, const int64_t* d2t, int64_t rows, int64_t width,
                         int64_t draft_vocab, int bf16, int64_t* tokens, float* confidences, int threads,
                         const float* scale, const int64_t* top_k, const float* top_p, const float* min_p,
                         const double* uniforms, float* probs) {
  run_walk(Walk{base, base_row_stride, base_slot_stride, hidden, hidden_row_stride, hidden_slot_stride, hidden_size,
                anchors, w1, w2, w2_vocab_stride, w2_rank_stride, rank, proj, proj_bias, proj_reads_markov, d2t, rows,
                width, draft_vocab, tokens, confidences, scale, top_k, top_p, min_p, uniforms, probs},
           bf16, threads);
}
}
