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
#include <stdint.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const uint16_t* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline float round_bf16(float value) {
  if (std::isnan(value)) return value;
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  bits &= 0xFFFF0000u;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

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
};

template <typename T>
void walk_row(const Walk& w, int64_t b, float* bias, float* embedding, bool bf16) {
  const T* base = static_cast<const T*>(w.base);
  const T* hidden = static_cast<const T*>(w.hidden);
  const T* w1 = static_cast<const T*>(w.w1);
  const T* w2 = static_cast<const T*>(w.w2);
  const T* proj = static_cast<const T*>(w.proj);
  int64_t prev = w.anchors[b];
  for (int64_t k = 0; k < w.width; ++k) {
    if (w1 != nullptr)
      for (int64_t r = 0; r < w.rank; ++r) embedding[r] = load(w1, prev * w.rank + r);
    const T* h = hidden + b * w.hidden_row_stride + k * w.hidden_slot_stride;
    if (proj != nullptr) {
      float sum = 0.0f;
      for (int64_t i = 0; i < w.hidden_size; ++i) sum += load(h, i) * load(proj, i);
      if (w.proj_reads_markov)
        for (int64_t r = 0; r < w.rank; ++r) sum += embedding[r] * load(proj, w.hidden_size + r);
      sum += w.proj_bias;
      w.confidences[b * w.width + k] = bf16 ? round_bf16(sum) : sum;
    }
    if (w1 != nullptr) {
      for (int64_t j = 0; j < w.draft_vocab; ++j) bias[j] = 0.0f;
      for (int64_t r = 0; r < w.rank; ++r) {
        const float e = embedding[r];
        const T* column = w2 + r * w.w2_rank_stride;
        if (w.w2_vocab_stride == 1) {
          for (int64_t j = 0; j < w.draft_vocab; ++j) bias[j] += load(column, j) * e;
        } else {
          for (int64_t j = 0; j < w.draft_vocab; ++j) bias[j] += load(column, j * w.w2_vocab_stride) * e;
        }
      }
      if (bf16)
        for (int64_t j = 0; j < w.draft_vocab; ++j) bias[j] = round_bf16(bias[j]);
    }
    const T* logits = base + b * w.base_row_stride + k * w.base_slot_stride;
    int64_t best = 0;
    float best_value = load(logits, 0) + (w1 != nullptr ? bias[0] : 0.0f);
    for (int64_t j = 1; j < w.draft_vocab && !std::isnan(best_value); ++j) {
      const float value = load(logits, j) + (w1 != nullptr ? bias[j] : 0.0f);
      if (value > best_value || std::isnan(value)) {  // the first maximum; a NaN wins, as in torch
        best = j;
        best_value = value;
      }
    }
    prev = w.d2t != nullptr ? w.d2t[best] : best;
    w.tokens[b * w.width + k] = prev;
  }
}

}  // namespace

extern "C" {

int64_t dspark_walk_max_rank() { return 4096; }

void dspark_greedy_walk(const void* base, int64_t base_row_stride, int64_t base_slot_stride, const void* hidden,
                        int64_t hidden_row_stride, int64_t hidden_slot_stride, int64_t hidden_size,
                        const int64_t* anchors, const void* w1, const void* w2, int64_t w2_vocab_stride,
                        int64_t w2_rank_stride, int64_t rank, const void* proj, float proj_bias,
                        int proj_reads_markov, const int64_t* d2t, int64_t rows, int64_t width,
                        int64_t draft_vocab, int bf16, int64_t* tokens, float* confidences, int threads) {
  const Walk walk{base, base_row_stride, base_slot_stride, hidden, hidden_row_stride, hidden_slot_stride,
                  hidden_size, anchors, w1, w2, w2_vocab_stride, w2_rank_stride, rank, proj, proj_bias,
                  proj_reads_markov, d2t, rows, width, draft_vocab, tokens, confidences};
#pragma omp parallel num_threads(threads) if (rows * width * draft_vocab * (rank + 1) >= (int64_t(1) << 20))
  {
    std::vector<float> bias(draft_vocab), embedding(rank > 0 ? rank : 1);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < rows; ++b) {
      if (bf16)
        walk_row<uint16_t>(walk, b, bias.data(), embedding.data(), true);
      else
        walk_row<float>(walk, b, bias.data(), embedding.data(), false);
    }
  }
}
}
