// Attention of query rows over keys and values read in place from a paged KV cache.
//
// out[t, h, :] = softmax(scale * q[t, h, :] . K[s, h / group, :] for s in keys(t)) @ V[s, h / group, :]
// where keys(t) = slots[key_start[t] .. key_start[t] + key_count[t]): the KV-cache rows the query
// at row t may see (a decode row sees its whole sequence; verify row i sees the prefix and window
// rows 0..i). Nothing is gathered or padded: each key row is read where the cache holds it.
//
// Each (row, head) is computed start to end by one thread, with the same operation order whatever
// the number of rows, heads or threads: a verify row gets the bits of the one-token decode that
// would have seen the same keys. A window's rows are attended together, so each key row is read
// once for the window, not once per row. Scores, softmax and the weighted sum are float32; the output is
// rounded once (bfloat16: to nearest even, as torch does). The query is scaled before the dot
// products, and e^x is a fixed polynomial (`simd16.h`), so results differ from torch's SDPA in the last bits.
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "simd16.h"

namespace {

constexpr int kLanes = 16;

// Softmax weights of one head in place; returns their sum. Fixed order for a given count.
inline float softmax_weights(float* scores, int64_t count) {
  const vec16 shift = vset1(max_of(scores, count));
  vec16 total = vzero();
  for (int64_t j = 0; j < count; j += kLanes) {
    const lanemask mask = first_lanes(count - j);
    const vec16 weights = exp_nonpositive(vsub(vload_masked(mask, scores + j), shift));
    vstore_masked(scores + j, mask, weights);
    total = vselect(mask, vadd(total, weights), total);
  }
  return vreduce_add(total);
}

#if defined(__AVX512F__)
constexpr int kVectorRegisters = 32, kRegistersPerVec = 1;  // a vec16 is one zmm register
#else
constexpr int kVectorRegisters = 16, kRegistersPerVec = 2;  // a vec16 is two ymm registers
#endif

constexpr int kMaxRows = 8;  // window rows attended together (a verify window is gamma + 1 rows)

// Rows 0..rows-1 of one request's window (they see the same keys: row r the first counts[r] of
// `slots`) and the `group` query heads that share one KV head: each key and value row is loaded
// once for all of them, where a row at a time read the prefix once per row (at 2,000 tokens of
// context that made a window of 5 cost 6x a decode step's attention). Each (row, head) does the
// same arithmetic in the same order whatever the rows and heads beside it, so a window row gets
// the bits of the one-token decode that sees the same keys. `max_rows` 1 is the decode case
// (its loops known to run once).
template <typename T, int chunks, int group, int max_rows>
void attend_rows(const T* q, int64_t q_stride_t, int64_t q_stride_h, const T* k, const T* v, int64_t kv_stride_s,
                 const int32_t* slots, const int64_t* counts, int rows, T* out, int64_t out_stride_t,
                 int64_t out_stride_h, float scale, std::vector<float>& scores) {
  const int n = max_rows == 1 ? 1 : rows;
  vec16 query[max_rows][group][chunks];
  int64_t longest = 0;
  for (int r = 0; r < n; ++r) {
    longest = counts[r] > longest ? counts[r] : longest;
    for (int h = 0; h < group; ++h)
      for (int c = 0; c < chunks; ++c)
        query[r][h][c] = vmul(vload(q + r * q_stride_t + h * q_stride_h + c * kLanes), vset1(scale));
  }
  scores.resize(static_cast<size_t>(n * group * longest));
  float* const score_rows = scores.data();  // (row r, head h) at (r * group + h) * longest
  // Scores 16 keys at a time: each key's dot products stay in a vector until `vsum16` reduces the
  // block's 16 at once. A key's score depends only on its own products and its place in its block
  // of 16, which is the same for every row that sees it.
  vec16 keys[kLanes][chunks];
  for (int64_t block = 0; block < longest; block += kLanes) {
    const int in_block = longest - block < kLanes ? static_cast<int>(longest - block) : kLanes;
    for (int i = 0; i < kLanes; ++i)
      for (int c = 0; c < chunks; ++c)
        keys[i][c] = i < in_block ? vload(k + static_cast<int64_t>(slots[block + i]) * kv_stride_s + c * kLanes)
                                  : vzero();
    for (int r = 0; r < n; ++r) {
      if (block >= counts[r]) continue;
      const lanemask seen = first_lanes(counts[r] - block);
      for (int h = 0; h < group; ++h) {
        vec16 products[kLanes];
        for (int i = 0; i < kLanes; ++i) {
          products[i] = vmul(query[r][h][0], keys[i][0]);
          for (int c = 1; c < chunks; ++c) products[i] = vfmadd(query[r][h][c], keys[i][c], products[i]);
        }
        vstore_masked(score_rows + (r * group + h) * longest + block, seen, vsum16(products));
      }
    }
  }
  float inverse[max_rows * group];
  for (int i = 0; i < n * group; ++i) inverse[i] = 1.0f / softmax_weights(score_rows + i * longest, counts[i / group]);
  // The weighted sum of values, a tile of (row, head) pairs at a time whose accumulators fit in
  // registers (all of a window's 8 x 3 x 4 spilled to the stack on every multiply-add); each value
  // row is read once per tile. Each pair still sums its keys in order, one multiply-add each.
  constexpr int kTile = std::max(1, (kVectorRegisters - 1) / (chunks * kRegistersPerVec) - 1);  // + value chunks
  for (int first = 0; first < n * group; first += kTile) {
    const int tile = n * group - first < kTile ? n * group - first : kTile;
    int64_t keys_seen = 0;  // the most keys a row of the tile sees
    for (int t = 0; t < tile; ++t) keys_seen = std::max(keys_seen, counts[(first + t) / group]);
    vec16 acc[kTile][chunks];
    for (int t = 0; t < kTile; ++t)
      for (int c = 0; c < chunks; ++c) acc[t][c] = vzero();
    for (int64_t j = 0; j < keys_seen; ++j) {
      const T* value = v + static_cast<int64_t>(slots[j]) * kv_stride_s;
      vec16 value_chunks[chunks];
      for (int c = 0; c < chunks; ++c) value_chunks[c] = vload(value + c * kLanes);
#pragma GCC unroll 24
      for (int t = 0; t < kTile; ++t) {
        if (t >= tile) break;
        if (j >= counts[(first + t) / group]) continue;
        const vec16 weight = vset1(score_rows[(first + t) * longest + j]);
        for (int c = 0; c < chunks; ++c) acc[t][c] = vfmadd(weight, value_chunks[c], acc[t][c]);
      }
    }
    for (int t = 0; t < tile; ++t) {
      const int r = (first + t) / group, h = (first + t) % group;
      for (int c = 0; c < chunks; ++c)
        vstore(out + r * out_stride_t + h * out_stride_h + c * kLanes, vmul(acc[t][c], vset1(inverse[first + t])));
    }
  }
}

// One work item: `rows` consecutive query rows of one request's window and one KV head.
struct Item {
  int64_t first_row;
  int rows;
  int kv_head;
};

// Each request's window (consecutive rows with the same key_start) in as few pieces as keep every
// thread busy: whole windows (up to kMaxRows rows) where the batch gives at least two items a
// thread, else each window split into about equal parts (a window of 5 at batch 1 with 3 KV heads
// on 2 threads: 3 + 2 rows, 6 items).
std::vector<Item> plan_items(const int64_t* key_start, int64_t rows, int kv_heads, int threads) {
  std::vector<std::pair<int64_t, int>> windows;
  for (int64_t t = 0; t < rows;) {
    int64_t end = t + 1;
    while (end < rows && key_start[end] == key_start[t]) ++end;
    windows.emplace_back(t, static_cast<int>(end - t));
    t = end;
  }
  const int64_t wanted = 2 * static_cast<int64_t>(threads);
  const int64_t whole = static_cast<int64_t>(windows.size()) * kv_heads;
  const int64_t parts_wanted = whole >= wanted ? 1 : (wanted + whole - 1) / whole;
  std::vector<Item> items;
  for (const auto& [first, length] : windows) {
    int64_t parts = parts_wanted < length ? parts_wanted : length;
    const int64_t pieces_needed = (length + kMaxRows - 1) / kMaxRows;
    parts = parts > pieces_needed ? parts : pieces_needed;
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t begin = first + p * length / parts;
      const int64_t stop = first + (p + 1) * length / parts;
      for (int g = 0; g < kv_heads; ++g) items.push_back({begin, static_cast<int>(stop - begin), g});
    }
  }
  return items;
}

template <typename T, int chunks, int group>
void attend(const T* q, int64_t q_stride_t, int64_t q_stride_h, const T* k, const T* v, int64_t kv_stride_s,
            int64_t kv_stride_h, const int32_t* slots, const int64_t* key_start, const int64_t* key_count, T* out,
            int64_t out_stride_t, int64_t out_stride_h, int64_t rows, int kv_heads, float scale, int threads) {
  const std::vector<Item> items = plan_items(key_start, rows, kv_heads, threads);
  const int64_t count = static_cast<int64_t>(items.size());
  int64_t work = 0;  // key rows read in all: small calls run on the calling thread (no fork/join)
  for (int64_t t = 0; t < rows; ++t) work += key_count[t] * kv_heads;
#pragma omp parallel num_threads(threads) if (work >= 4096)
  {
    std::vector<float> scores;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < count; ++i) {
      const Item& item = items[i];
      const int64_t t = item.first_row;
      const int g = item.kv_head;
      const auto run = item.rows == 1 ? attend_rows<T, chunks, group, 1> : attend_rows<T, chunks, group, kMaxRows>;
      run(q + t * q_stride_t + g * group * q_stride_h, q_stride_t, q_stride_h, k + g * kv_stride_h,
          v + g * kv_stride_h, kv_stride_s, slots + key_start[t], key_count + t, item.rows,
          out + t * out_stride_t + g * group * out_stride_h, out_stride_t, out_stride_h, scale, scores);
    }
  }
}

using AttendFn = void (*)(const void*, int64_t, int64_t, const void*, const void*, int64_t, int64_t, const int32_t*,
                          const int64_t*, const int64_t*, void*, int64_t, int64_t, int64_t, int, float, int);

template <typename T, int chunks, int group>
void attend_erased(const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k, const void* v,
                   int64_t kv_stride_s, int64_t kv_stride_h, const int32_t* slots, const int64_t* key_start,
                   const int64_t* key_count, void* out, int64_t out_stride_t, int64_t out_stride_h, int64_t rows,
                   int kv_heads, float scale, int threads) {
  attend<T, chunks, group>(static_cast<const T*>(q), q_stride_t, q_stride_h, static_cast<const T*>(k),
                           static_cast<const T*>(v), kv_stride_s, kv_stride_h, slots, key_start, key_count,
                           static_cast<T*>(out), out_stride_t, out_stride_h, rows, kv_heads, scale, threads);
}

// Instantiated shapes: head_dim 16, 32, 64 or 128, 1-8 query heads per KV head (the dense models
// we know of, and the test fixtures); anything else stays with the caller's own attention.
template <typename T, int chunks>
AttendFn pick_group(int group) {
  switch (group) {
    case 1: return attend_erased<T, chunks, 1>;
    case 2: return attend_erased<T, chunks, 2>;
    case 3: return attend_erased<T, chunks, 3>;
    case 4: return attend_erased<T, chunks, 4>;
    case 5: return attend_erased<T, chunks, 5>;
    case 6: return attend_erased<T, chunks, 6>;
    case 7: return attend_erased<T, chunks, 7>;
    case 8: return attend_erased<T, chunks, 8>;
    default: return nullptr;
  }
}

template <typename T>
AttendFn pick(int head_dim, int group) {
  if (head_dim == 16) return pick_group<T, 1>(group);
  if (head_dim == 32) return pick_group<T, 2>(group);
  if (head_dim == 64) return pick_group<T, 4>(group);
  if (head_dim == 128) return pick_group<T, 8>(group);
  return nullptr;
}

}  // namespace

extern "C" {
int dspark_attention_supports(int head_dim, int group) { return pick<float>(head_dim, group) != nullptr; }

// q: [rows, q_heads, D] and out alike (element strides per row and head); k, v: the cache of one
// layer, [cache rows, kv_heads, D] (strides per cache row and head). All bfloat16 when bf16, else
// float32. (D, q_heads / kv_heads) must be supported (`dspark_attention_supports`); else nothing runs.
void dspark_paged_attention(const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k, const void* v,
                            int64_t kv_stride_s, int64_t kv_stride_h, const int32_t* slots, const int64_t* key_start,
                            const int64_t* key_count, void* out, int64_t out_stride_t, int64_t out_stride_h,
                            int64_t rows, int q_heads, int kv_heads, int D, float scale, int bf16, int threads) {
  const AttendFn fn = bf16 ? pick<uint16_t>(D, q_heads / kv_heads) : pick<float>(D, q_heads / kv_heads);
  if (fn == nullptr || q_heads % kv_heads != 0) return;
  fn(q, q_stride_t, q_stride_h, k, v, kv_stride_s, kv_stride_h, slots, key_start, key_count, out, out_stride_t,
     out_stride_h, rows, kv_heads, scale, threads);
}
}
