// Math shared by this package's kernels (included by their .cpp; `build.py` hashes every header
// beside a source, so a change here rebuilds them all): scalar bfloat16 loads and rounding (the
// vector math is in `simd16.h`).
#pragma once

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
