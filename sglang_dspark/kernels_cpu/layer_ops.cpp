// The small per-token ops of a decoder layer, one call each instead of 2-40 torch ops:
// residual add + RMSNorm, neox-style rotary embedding of queries and keys, and SiLU-and-multiply.
//
// Each works row by row, each row by one thread in a fixed order, so a row's result does not depend
// on the rows beside it (a verify window reproduces the one-token decode bit for bit). Arithmetic
// is float32, rounded once at the end (bfloat16: to nearest even, as torch does).
#include <stdint.h>

#include <cmath>
#include <cstring>

#include "simd_math.h"
#include "simd16.h"

namespace {

inline void store(float* p, int64_t i, float value) { p[i] = value; }

inline void store(uint16_t* p, int64_t i, float value) { p[i] = bf16_bits(value); }

// The first lanes of `mask` from p (the others 0, never read).
inline vec16 load_lanes(lanemask mask, const float* p) { return mask == 0xFFFF ? vload(p) : vload_masked(mask, p); }
inline vec16 load_lanes(lanemask mask, const uint16_t* p) {
  if (mask == 0xFFFF) return vload(p);
  uint16_t lanes[16] = {0};
  for (int i = 0; i < 16 && (mask >> i) & 1; ++i) lanes[i] = p[i];
  return vload(lanes);
}

// x (+ residual) -> residual_out (rounded to the dtype), out = x * rsqrt(mean(x^2) + eps) * weight.
// 16 lanes at a time: lane j sums the squares of elements j, j + 16, ... by fused multiply-adds, the
// lanes then add up in order. A scalar loop cost ~0.9 us a row of 576 here, ~1.1 ms of a forward of
// 16 rows (61 norms); this ~0.2 us.
template <typename T, typename W>
void add_rmsnorm(const T* x, int64_t x_stride, const T* residual, int64_t residual_stride, const W* weight, T* out,
                 T* residual_out, int64_t rows, int64_t hidden, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * hidden >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    alignas(64) float row[16384];
    const int64_t n = hidden < 16384 ? hidden : 16384;
    vec16 squares = vzero();
    for (int64_t i = 0; i < n; i += 16) {
      const lanemask mask = first_lanes(n - i);
      vec16 value = load_lanes(mask, x + r * x_stride + i);
      if (residual != nullptr) {
        value = vadd(value, load_lanes(mask, residual + r * residual_stride + i));
        vstore_masked(residual_out + r * hidden + i, mask, value);
      }
      vstore_masked(row + i, mask, value);
      squares = vfmadd(value, value, squares);  // masked-off lanes hold 0
    }
    alignas(64) float lanes[16];
    vstore(lanes, squares);
    float total = 0.0f;
    for (int lane = 0; lane < 16; ++lane) total += lanes[lane];
    const vec16 scale = vset1(1.0f / std::sqrt(total / static_cast<float>(hidden) + eps));
    for (int64_t i = 0; i < n; i += 16) {
      const lanemask mask = first_lanes(n - i);
      vstore_masked(out + r * hidden + i, mask, vmul(vmul(vload_masked(mask, row + i), scale), load_lanes(mask, weight + i)));
    }
  }
}

// Neox rotation of the first `rotary_dim` dims of every head (the rest copied):
// o1 = x1 cos - x2 sin, o2 = x2 cos + x1 sin, cos/sin = cache[position] halves.
template <typename T, typename C>
void rope_rows(const int64_t* positions, const T* x, int64_t x_stride, T* out, int64_t rows, int heads, int head_size,
               int rotary_dim, const C* cache, int64_t cache_stride) {
  const int half = rotary_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const C* cos = cache + positions[r] * cache_stride;
    const C* sin = cos + half;
    for (int h = 0; h < heads; ++h) {
      const T* in = x + r * x_stride + static_cast<int64_t>(h) * head_size;
      T* o = out + (r * heads + h) * static_cast<int64_t>(head_size);
      for (int i = 0; i < half; ++i) {
        const float x1 = load(in, i), x2 = load(in, i + half), c = load(cos, i), s = load(sin, i);
        store(o, i, x1 * c - x2 * s);
        store(o, i + half, x2 * c + x1 * s);
      }
      for (int i = rotary_dim; i < head_size; ++i) o[i] = in[i];
    }
  }
}

// Per head: RMSNorm over head_size (float32, weight applied), then the rotate-half rotation by
// this row's cos/sin [head_size] (the drafter's q/k path: Qwen3's q_norm/k_norm, then RoPE).
template <typename T>
void head_norm_rope_rows(const T* x, int64_t x_stride, T* out, int64_t rows, int heads, int head_size, const T* weight,
                         float eps, const T* cos, int64_t cos_stride, const T* sin, int64_t sin_stride) {
  const int half = head_size / 2;
  float y[1024];
  for (int64_t r = 0; r < rows; ++r) {
    const T* c = cos + r * cos_stride;
    const T* s = sin + r * sin_stride;
    for (int h = 0; h < heads; ++h) {
      const T* in = x + r * x_stride + static_cast<int64_t>(h) * head_size;
      T* o = out + (r * heads + h) * static_cast<int64_t>(head_size);
      float sum = 0.0f;
      for (int i = 0; i < head_size; ++i) {
        y[i] = load(in, i);
        sum += y[i] * y[i];
      }
      const float scale = 1.0f / std::sqrt(sum / static_cast<float>(head_size) + eps);
      for (int i = 0; i < head_size; ++i) y[i] *= scale * load(weight, i);
      for (int i = 0; i < half; ++i) {
        store(o, i, y[i] * load(c, i) - y[i + half] * load(s, i));
        store(o, i + half, y[i + half] * load(c, i + half) + y[i] * load(s, i + half));
      }
    }
  }
}

// The index of a row's largest value, the first one on ties and the first NaN if any (as
// torch.argmax). Each of 16 lanes keeps its own first maximum and where it was (as a float: exact
// below 2^24 columns); the lanes are then reduced to the smallest index holding the overall maximum.
template <typename T>
int64_t row_argmax(const T* row, int64_t cols) {
  int64_t i = 0;
  int64_t best_index = 0;
  float best = -INFINITY;
  if (cols >= 16 && cols < (int64_t(1) << 24)) {
    vec16 lane_max = vset1(-INFINITY);
    vec16 lane_index = vzero();
    alignas(64) const float first[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vec16 index = vload(first);
    const vec16 sixteen = vset1(16.0f);
    lanemask nan_seen = 0;
    for (; i + 16 <= cols; i += 16) {
      const vec16 v = vload(row + i);
      nan_seen |= vnan(v);
      const lanemask greater = vgt(v, lane_max);
      lane_max = vselect(greater, v, lane_max);
      lane_index = vselect(greater, index, lane_index);
      index = vadd(index, sixteen);
    }
    if (nan_seen) {
      for (int64_t j = 0; j < i; ++j)
        if (std::isnan(load(row, j))) return j;
    }
    alignas(64) float maxima[16], indices[16];
    vstore(maxima, lane_max);
    vstore(indices, lane_index);
    best = vreduce_max(lane_max);
    best_index = cols;
    for (int lane = 0; lane < 16; ++lane)
      if (maxima[lane] == best && static_cast<int64_t>(indices[lane]) < best_index)
        best_index = static_cast<int64_t>(indices[lane]);
  }
  for (; i < cols; ++i) {
    const float v = load(row, i);
    if (std::isnan(v)) return i;
    if (v > best) {  // best_index stays 0 for a row of -inf, as torch.argmax
      best = v;
      best_index = i;
    }
  }
  return best_index;
}

// -|x| (min(x, -x) without a vector min).
inline vec16 negative_abs(vec16 x) { return vsub(vzero(), vmax(x, vsub(vzero(), x))); }

// silu(x) = x * sigmoid(x), with t = e^-|x| so that the exponent never overflows:
// sigmoid(x) = 1 / (1 + t) for x >= 0, t / (1 + t) below.
inline vec16 silu(vec16 x) {
  const vec16 t = exp_nonpositive(negative_abs(x));
  const vec16 one = vset1(1.0f);
  return vdiv(vmul(x, vselect(vge(x, vzero()), one, t)), vadd(one, t));
}

// out[r] = silu(gate) * up for x[r] = [gate (d), up (d)]. For bfloat16 the SiLU is rounded to
// bfloat16 before the product and the product again, as torch's `F.silu(gate) * up` rounds.
template <typename T>
void silu_and_mul(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t d, int threads) {
  constexpr bool kRoundSilu = sizeof(T) == 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * d >= 262144)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * x_stride;
    const T* up = gate + d;
    T* o = out + r * d;
    for (int64_t i = 0; i < d; i += 16) {
      const lanemask mask = first_lanes(d - i);
      vec16 s = silu(load_lanes(mask, gate + i));
      if constexpr (kRoundSilu) s = vround_bf16(s);
      vstore_masked(o + i, mask, vmul(s, load_lanes(mask, up + i)));
    }
  }
}
}  // namespace

extern "C" {
int dspark_layer_ops_max_hidden() { return 16384; }

// x, residual, out, residual_out: [rows, hidden] (x and residual with their row strides; out and
// residual_out contiguous); residual may be null (then residual_out is unused). bf16: all four are
// bfloat16 (else float32); weight_bf16: the weight is.
void dspark_add_rmsnorm(const void* x, int64_t x_stride, const void* residual, int64_t residual_stride,
                        const void* weight, void* out, void* residual_out, int64_t rows, int64_t hidden, float eps,
                        int bf16, int weight_bf16, int threads) {
  if (hidden > 16384) return;
  if (bf16 && weight_bf16)
    add_rmsnorm(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(residual), residual_stride,
                static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out),
                static_cast<uint16_t*>(residual_out), rows, hidden, eps, threads);
  else if (bf16)
    add_rmsnorm(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(residual), residual_stride,
                static_cast<const float*>(weight), static_cast<uint16_t*>(out), static_cast<uint16_t*>(residual_out),
                rows, hidden, eps, threads);
  else if (weight_bf16)
    add_rmsnorm(static_cast<const float*>(x), x_stride, static_cast<const float*>(residual), residual_stride,
                static_cast<const uint16_t*>(weight), static_cast<float*>(out), static_cast<float*>(residual_out),
                rows, hidden, eps, threads);
  else
    add_rmsnorm(static_cast<const float*>(x), x_stride, static_cast<const float*>(residual), residual_stride,
                static_cast<const float*>(weight), static_cast<float*>(out), static_cast<float*>(residual_out),
                rows, hidden, eps, threads);
}

// q, k: [rows, heads * head_size] with their row strides; q_out, k_out: contiguous, same shapes;
// cache: [cache_rows, rotary_dim] (cos half, then sin half) with row stride cache_stride. Returns 0,
// or -1 (writing nothing) where a position lies outside 0..cache_rows-1: checked here, where it costs
// nothing, instead of by two tensor reductions in Python on every layer of every forward.
int dspark_rope_neox(const int64_t* positions, const void* q, int64_t q_stride, void* q_out, int q_heads,
                     const void* k, int64_t k_stride, void* k_out, int k_heads, int64_t rows, int head_size,
                     int rotary_dim, const void* cache, int64_t cache_stride, int64_t cache_rows, int bf16,
                     int cache_bf16) {
  for (int64_t r = 0; r < rows; ++r)
    if (positions[r] < 0 || positions[r] >= cache_rows) return -1;
  for (int which = 0; which < 2; ++which) {
    const void* x = which == 0 ? q : k;
    void* out = which == 0 ? q_out : k_out;
    const int64_t stride = which == 0 ? q_stride : k_stride;
    const int heads = which == 0 ? q_heads : k_heads;
    if (bf16 && cache_bf16)
      rope_rows(positions, static_cast<const uint16_t*>(x), stride, static_cast<uint16_t*>(out), rows, heads,
                head_size, rotary_dim, static_cast<const uint16_t*>(cache), cache_stride);
    else if (bf16)
      rope_rows(positions, static_cast<const uint16_t*>(x), stride, static_cast<uint16_t*>(out), rows, heads,
                head_size, rotary_dim, static_cast<const float*>(cache), cache_stride);
    else if (cache_bf16)
      rope_rows(positions, static_cast<const float*>(x), stride, static_cast<float*>(out), rows, heads, head_size,
                rotary_dim, static_cast<const uint16_t*>(cache), cache_stride);
    else
      rope_rows(positions, static_cast<const float*>(x), stride, static_cast<float*>(out), rows, heads, head_size,
                rotary_dim, static_cast<const float*>(cache), cache_stride);
  }
  return 0;
}

// x: [rows, heads * head_size] with row stride x_stride; out: contiguous, same shape; weight:
// [head_size]; cos, sin: [rows, head_size] with their row strides. All bfloat16 (bf16) or float32.
void dspark_head_norm_rope(const void* x, int64_t x_stride, void* out, int64_t rows, int heads, int head_size,
                           const void* weight, float eps, const void* cos, int64_t cos_stride, const void* sin,
                           int64_t sin_stride, int bf16) {
  if (head_size > 1024 || head_size % 2 != 0) return;
  if (bf16)
    head_norm_rope_rows(static_cast<const uint16_t*>(x), x_stride, static_cast<uint16_t*>(out), rows, heads, head_size,
                        static_cast<const uint16_t*>(weight), eps, static_cast<const uint16_t*>(cos), cos_stride,
                        static_cast<const uint16_t*>(sin), sin_stride);
  else
    head_norm_rope_rows(static_cast<const float*>(x), x_stride, static_cast<float*>(out), rows, heads, head_size,
                        static_cast<const float*>(weight), eps, static_cast<const float*>(cos), cos_stride,
                        static_cast<const float*>(sin), sin_stride);
}

// x: [rows, cols] with row stride x_stride (elements), float32 or (bf16) bfloat16; out: [rows].
// Rows are split over threads only when the call is large enough to repay the fork.
void dspark_row_argmax(const void* x, int64_t rows, int64_t cols, int64_t x_stride, int bf16, int64_t* out,
                       int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * cols >= (int64_t(1) << 21))
  for (int64_t r = 0; r < rows; ++r)
    out[r] = bf16 ? row_argmax(static_cast<const uint16_t*>(x) + r * x_stride, cols)
                  : row_argmax(static_cast<const float*>(x) + r * x_stride, cols);
}

// x: [rows, 2 * d] with row stride x_stride (gate then up); out: [rows, d] contiguous; both
// bfloat16 (bf16) or float32.
void dspark_silu_and_mul(const void* x, int64_t x_stride, void* out, int64_t rows, int64_t d, int bf16, int threads) {
  if (bf16)
    silu_and_mul(static_cast<const uint16_t*>(x), x_stride, static_cast<uint16_t*>(out), rows, d, threads);
  else
    silu_and_mul(static_cast<const float*>(x), x_stride, static_cast<float*>(out), rows, d, threads);
}
}
