// Sixteen float32 lanes for this package's kernels: one AVX-512 register, or two AVX2 registers on
// a CPU without AVX-512F (`build.py` compiles with -march=native, so the CPU picks). The kernels
// are written once against these functions; with AVX-512 each is the one intrinsic it names.
//
// Masks are 16-bit lane masks (bit i: lane i). Every reduction sums or compares in one fixed order
// for a given build, so a row's result does not depend on the rows beside it on either ISA. The two
// ISAs may differ from each other in the last bits of a sum (their reduction trees differ).
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <cmath>
#include <cstring>

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
#error "sglang-dspark's CPU kernels need AVX-512F, or AVX2 with FMA"
#endif

using lanemask = uint16_t;

// The first `n` of 16 lanes (none for n <= 0, all for n >= 16).
inline lanemask first_lanes(int64_t n) {
  return n >= 16 ? static_cast<lanemask>(0xFFFF) : n <= 0 ? 0 : static_cast<lanemask>((1u << n) - 1);
}

#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
using vec16 = __m512;

inline vec16 vset1(float a) { return _mm512_set1_ps(a); }
inline vec16 vzero() { return _mm512_setzero_ps(); }
inline vec16 vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec16 vload(const uint16_t* p) {  // bfloat16, widened
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vec16 vload_masked(lanemask mask, const float* p) { return _mm512_maskz_loadu_ps(mask, p); }
inline void vstore(float* p, vec16 v) { _mm512_storeu_ps(p, v); }
inline void vstore_masked(float* p, lanemask mask, vec16 v) { _mm512_mask_storeu_ps(p, mask, v); }
inline vec16 vadd(vec16 a, vec16 b) { return _mm512_add_ps(a, b); }
inline vec16 vsub(vec16 a, vec16 b) { return _mm512_sub_ps(a, b); }
inline vec16 vmul(vec16 a, vec16 b) { return _mm512_mul_ps(a, b); }
inline vec16 vdiv(vec16 a, vec16 b) { return _mm512_div_ps(a, b); }
inline vec16 vmax(vec16 a, vec16 b) { return _mm512_max_ps(a, b); }
inline vec16 vfmadd(vec16 a, vec16 b, vec16 c) { return _mm512_fmadd_ps(a, b, c); }   // a * b + c
inline vec16 vfnmadd(vec16 a, vec16 b, vec16 c) { return _mm512_fnmadd_ps(a, b, c); } // c - a * b
inline float vreduce_add(vec16 v) { return _mm512_reduce_add_ps(v); }
inline float vreduce_max(vec16 v) { return _mm512_reduce_max_ps(v); }
inline lanemask vge(vec16 a, vec16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline lanemask vgt(vec16 a, vec16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline lanemask vnan(vec16 a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
// Lanes of `mask` from `a`, the others from `b`.
inline vec16 vselect(lanemask mask, vec16 a, vec16 b) { return _mm512_mask_mov_ps(b, mask, a); }
inline vec16 vround(vec16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec16 vscale_pow2(vec16 y, vec16 n) { return _mm512_scalef_ps(y, n); }  // y * 2^n, n integral

// Lane i: the sum of v[i]'s 16 lanes, for 16 vectors at once (a transposing add tree: ~3
// instructions a vector, where `vreduce_add` takes ~8 for one). Fixed order for each lane.
inline vec16 vsum16(const vec16 v[16]) {
  __m512 pairs[8];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 quads[4];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of vectors 4i .. 4i+3
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}

// float32 -> bfloat16 bits per lane: to nearest even, NaN -> 0x7FC0 (what torch's .to(bfloat16) does).
inline void vstore_bf16_masked(uint16_t* p, lanemask mask, vec16 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, vnan(v), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(rounded));
}

// v rounded to bfloat16 as `vstore_bf16_masked` rounds it, and widened back, in registers.
inline vec16 vround_bf16(vec16 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))),
                                     _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  rounded = _mm512_mask_mov_epi32(rounded, vnan(v), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(rounded);
}

#else  // AVX2 + FMA: lanes 0-7 in lo, 8-15 in hi.
constexpr bool kAvx512 = false;
struct vec16 {
  __m256 lo, hi;
};

inline vec16 vset1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline vec16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vec16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen_bf16(__m128i raw) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)); }
inline vec16 vload(const uint16_t* p) {
  return {widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
// All-ones in the 32-bit lanes whose bit is set in the low 8 bits of `bits`.
inline __m256i lane_bits(unsigned bits) {
  const __m256i which = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits & 0xFF)), which), which);
}
inline vec16 vload_masked(lanemask mask, const float* p) {  // masked-off lanes are 0 and never read
  return {_mm256_maskload_ps(p, lane_bits(mask)), _mm256_maskload_ps(p + 8, lane_bits(mask >> 8))};
}
inline void vstore(float* p, vec16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void vstore_masked(float* p, lanemask mask, vec16 v) {
  _mm256_maskstore_ps(p, lane_bits(mask), v.lo);
  _mm256_maskstore_ps(p + 8, lane_bits(mask >> 8), v.hi);
}
inline vec16 vadd(vec16 a, vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vec16 vsub(vec16 a, vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vec16 vmul(vec16 a, vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vec16 vdiv(vec16 a, vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vec16 vmax(vec16 a, vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vec16 vfmadd(vec16 a, vec16 b, vec16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline vec16 vfnmadd(vec16 a, vec16 b, vec16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline float reduce8_add(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline float vreduce_add(vec16 v) { return reduce8_add(_mm256_add_ps(v.lo, v.hi)); }
inline float vreduce_max(vec16 v) {
  const __m256 m = _mm256_max_ps(v.lo, v.hi);
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
inline lanemask bits_of(__m256 lo, __m256 hi) {
  return static_cast<lanemask>(_mm256_movemask_ps(lo) | (_mm256_movemask_ps(hi) << 8));
}
inline lanemask vge(vec16 a, vec16 b) {
  return bits_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ));
}
inline lanemask vgt(vec16 a, vec16 b) {
  return bits_of(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ));
}
inline lanemask vnan(vec16 a) {
  return bits_of(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q), _mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q));
}
inline vec16 vselect(lanemask mask, vec16 a, vec16 b) {
  return {_mm256_blendv_ps(b.lo, a.lo, _mm256_castsi256_ps(lane_bits(mask))),
          _mm256_blendv_ps(b.hi, a.hi, _mm256_castsi256_ps(lane_bits(mask >> 8)))};
}
inline vec16 vround(vec16 a) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kNearest), _mm256_round_ps(a.hi, kNearest)};
}
// y * 2^n for integral n in [-252, 254], as two exact power-of-two factors (2^-127 alone is not a
// normal float).
inline __m256 scale_pow2(__m256 y, __m256 n) {
  const __m256i whole = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(whole, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(whole, half), bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, first), second);
}
inline vec16 vscale_pow2(vec16 y, vec16 n) { return {scale_pow2(y.lo, n.lo), scale_pow2(y.hi, n.hi)}; }

// Lane i of the result: the sum of v[i]'s 8 lanes, for 8 vectors (a transposing add tree).
inline __m256 sum8(const __m256 v[8]) {
  __m256 pairs[4];
  for (int i = 0; i < 4; ++i)  // per 128-bit half: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  const __m256 first = _mm256_add_ps(_mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 second = _mm256_add_ps(_mm256_shuffle_ps(pairs[2], pairs[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm256_shuffle_ps(pairs[2], pairs[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_permute2f128_ps(first, second, 0x20), _mm256_permute2f128_ps(first, second, 0x31));
}
// Lane i: the sum of v[i]'s 16 lanes, for 16 vectors at once. Fixed order for each lane.
inline vec16 vsum16(const vec16 v[16]) {
  __m256 folded[16];
  for (int i = 0; i < 16; ++i) folded[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {sum8(folded), sum8(folded + 8)};
}

inline __m256i bf16_rounded(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline vec16 vround_bf16(vec16 v) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_rounded(v.lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(bf16_rounded(v.hi), 16))};
}
inline void vstore_bf16_masked(uint16_t* p, lanemask mask, vec16 v) {
  // packus interleaves 128-bit halves: [lo 0-3, hi 0-3, lo 4-7, hi 4-7]; the permute restores order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_rounded(v.lo), bf16_rounded(v.hi)), 0xD8);
  if (mask == 0xFFFF) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
    return;
  }
  alignas(32) uint16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), packed);
  for (int i = 0; i < 16; ++i)
    if (mask >> i & 1) p[i] = lanes[i];
}
#endif

inline void vstore(uint16_t* p, vec16 v) { vstore_bf16_masked(p, 0xFFFF, v); }
inline void vstore_masked(uint16_t* p, lanemask mask, vec16 v) { vstore_bf16_masked(p, mask, v); }

// The largest of values[0, count) (-inf for none), 16 lanes at a time in a fixed order.
inline float max_of(const float* values, int64_t count) {
  vec16 best = vset1(-INFINITY);
  for (int64_t j = 0; j < count; j += 16) {
    const lanemask mask = first_lanes(count - j);
    best = vselect(mask, vmax(best, vload_masked(mask, values + j)), best);
  }
  return vreduce_max(best);
}

// e^x for x <= 0 (scores minus their maximum): Cephes expf's polynomial, within 2 ulp of expf,
// the same bits on every call (a fixed operation order, no library call).
inline vec16 exp_nonpositive(vec16 x) {
  x = vmax(x, vset1(-88.0f));
  const vec16 n = vround(vmul(x, vset1(1.44269504088896341f)));
  x = vfnmadd(n, vset1(0.693359375f), x);
  x = vfnmadd(n, vset1(-2.12194440e-4f), x);
  const vec16 z = vmul(x, x);
  vec16 y = vset1(1.9875691500e-4f);
  y = vfmadd(y, x, vset1(1.3981999507e-3f));
  y = vfmadd(y, x, vset1(8.3333452107e-3f));
  y = vfmadd(y, x, vset1(4.1665795894e-2f));
  y = vfmadd(y, x, vset1(1.6666665459e-1f));
  y = vfmadd(y, x, vset1(5.0000001201e-1f));
  y = vfmadd(y, z, vadd(x, vset1(1.0f)));
  return vscale_pow2(y, n);
}
