// Attention of query rows over keys and values read in place from a paged KV cache.
//
// out[t, h, :] = softmax(scale * q[t, h, :] . K[s, h / group, :] for s in keys(t)) @ V[s, h / group, :]
// where keys(t) = slots[key_start[t] .. key_start[t] + key_count[t]): the KV-cache rows the query
// at row t may see (a decode row sees its whole sequence; verify row i sees the prefix and window
// rows 0..i). Nothing is gathered or padded: each key row is read where the cache holds it.
//
// Each (row, head) is computed start to end by one thread, with the same operation order whatever
// the number of rows, heads or threads: a verify row gets the bits of the one-token decode that
// would have seen the same keys. Scores, softmax and the weighted sum are float32; the output is
// rounded once (bfloat16: to nearest even, as torch does). The query is scaled before the dot
// products, and e^x is a fixed polynomial (`simd16.h`), so results differ from torch's SDPA in the last bits.
#include <stdint.h>

#include <cmath>
#include <cstring>
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

// The `group` query heads of one row that share a KV head: each key and value row is loaded once
// for all of them; each head's arithmetic is the same whatever the group size.
template <typename T, int chunks, int group>
void attend_group(const T* q, int64_t q_stride_h, const T* k, const T* v, int64_t kv_stride_s,
                  const int32_t* slots, int64_t count, T* out, int64_t out_stride_h, float scale,
                  std::vector<float>& scores) {
  vec16 query[group][chunks];
  for (int h = 0; h < group; ++h)
    for (int c = 0; c < chunks; ++c) query[h][c] = vmul(vload(q + h * q_stride_h + c * kLanes), vset1(scale));
  scores.resize(static_cast<size_t>(group * count));
  for (int64_t j = 0; j < count; ++j) {
    const T* key = k + static_cast<int64_t>(slots[j]) * kv_stride_s;
    vec16 key_chunks[chunks];
    for (int c = 0; c < chunks; ++c) key_chunks[c] = vload(key + c * kLanes);
    for (int h = 0; h < group; ++h) {
      vec16 dot = vmul(query[h][0], key_chunks[0]);
      for (int c = 1; c < chunks; ++c) dot = vfmadd(query[h][c], key_chunks[c], dot);
      scores[h * count + j] = vreduce_add(dot);
    }
  }
  float inverse[group];
  for (int h = 0; h < group; ++h) inverse[h] = 1.0f / softmax_weights(scores.data() + h * count, count);
  vec16 acc[group][chunks];
  for (int h = 0; h < group; ++h)
    for (int c = 0; c < chunks; ++c) acc[h][c] = vzero();
  for (int64_t j = 0; j < count; ++j) {
    const T* value = v + static_cast<int64_t>(slots[j]) * kv_stride_s;
    for (int c = 0; c < chunks; ++c) {
      const vec16 value_chunk = vload(value + c * kLanes);
      for (int h = 0; h < group; ++h)
        acc[h][c] = vfmadd(vset1(scores[h * count + j]), value_chunk, acc[h][c]);
    }
  }
  for (int h = 0; h < group; ++h)
    for (int c = 0; c < chunks; ++c)
      vstore(out + h * out_stride_h + c * kLanes, vmul(acc[h][c], vset1(inverse[h])));
}

template <typename T, int chunks, int group>
void attend(const T* q, int64_t q_stride_t, int64_t q_stride_h, const T* k, const T* v, int64_t kv_stride_s,
            int64_t kv_stride_h, const int32_t* slots, const int64_t* key_start, const int64_t* key_count, T* out,
            int64_t out_stride_t, int64_t out_stride_h, int64_t rows, int kv_heads, float scale, int threads) {
  const int64_t items = rows * kv_heads;
  int64_t work = 0;  // key rows read in all: small calls run on the calling thread (no fork/join)
  for (int64_t t = 0; t < rows; ++t) work += key_count[t] * kv_heads;
#pragma omp parallel num_threads(threads) if (work >= 4096)
  {
    std::vector<float> scores;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t t = item / kv_heads;
      const int g = static_cast<int>(item % kv_heads);
      attend_group<T, chunks, group>(q + t * q_stride_t + g * group * q_stride_h, q_stride_h, k + g * kv_stride_h,
                                     v + g * kv_stride_h, kv_stride_s, slots + key_start[t], key_count[t],
                                     out + t * out_stride_t + g * group * out_stride_h, out_stride_h, scale, scores);
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
