// Math shared by this package's kernels (included by their .cpp; `build.py` hashes every header
// beside a source, so a change here rebuilds them all): bfloat16 loads and rounding, vector e^x.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <cmath>
#include <cstring>

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const uint16_t* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// The bfloat16 nearest to `value` (ties to even, as torch rounds; a NaN becomes 0x7FC0).
inline uint16_t bf16_bits(float value) {
  if (std::isnan(value)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// `value` rounded to bfloat16 and widened back.
inline float round_bf16(float value) {
  const uint16_t rounded = bf16_bits(value);
  return load(&rounded, 0);
}

// e^x for x <= 0 (scores minus their maximum): Cephes expf's polynomial, within 2 ulp of expf,
// the same bits on every call (a fixed operation order, no library call).
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3333452107e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, z, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}
