// y[M,N] = x[M,K] @ W[N,K]^T for small M, with W packed once into 32-column panels [P][K][32]
// (float32, or bfloat16 widened to float32 in registers). Each panel is streamed from memory once
// per call and reused from L2 for every 8 rows of x, so 1-16 rows cost about what one row costs.
// Every output element sums over k in the same order whatever M is: a row's result does not
// depend on the rows beside it (a verify window reproduces the one-token decode bit for bit).
#include <immintrin.h>
#include <stdint.h>

#include <cstring>
#include <vector>

namespace {

constexpr int kPanel = 32;        // output columns per panel: two 16-lane registers
constexpr int kRowsPerPass = 8;   // rows of x per pass over a panel: 16 accumulators
constexpr int kPrefetchRows = 32; // prefetch this many panel rows (k) ahead

inline void load_weights(const float* panel, int64_t k, __m512& w0, __m512& w1) {
  w0 = _mm512_loadu_ps(panel + k * kPanel);
  w1 = _mm512_loadu_ps(panel + k * kPanel + 16);
}

inline void load_weights(const uint16_t* panel, int64_t k, __m512& w0, __m512& w1) {
  const __m512i raw = _mm512_loadu_si512(panel + k * kPanel);
  w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
  w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
}

inline void store(float* y, int64_t offset, __mmask16 mask, __m512 values) {
  _mm512_mask_storeu_ps(y + offset, mask, values);
}

// float32 -> bfloat16, rounding to nearest even, NaN -> 0x7FC0: what torch's .to(bfloat16) does.
inline void store(uint16_t* y, int64_t offset, __mmask16 mask, __m512 values) {
  const __m512i bits = _mm512_castps_si512(values);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(y + offset, mask, _mm512_cvtepi32_epi16(rounded));
}

template <int M, typename W, typename Y>
inline void panel_pass(const float* x, int64_t K, const W* panel, Y* y, int64_t N, int cols) {
  __m512 acc0[M], acc1[M];
  for (int m = 0; m < M; ++m) {
    acc0[m] = _mm512_setzero_ps();
    acc1[m] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchRows) * kPanel), _MM_HINT_T0);
    __m512 w0, w1;
    load_weights(panel, k, w0, w1);
    for (int m = 0; m < M; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * K + k]);
      acc0[m] = _mm512_fmadd_ps(xb, w0, acc0[m]);
      acc1[m] = _mm512_fmadd_ps(xb, w1, acc1[m]);
    }
  }
  const __mmask16 mask0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 mask1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int m = 0; m < M; ++m) {
    store(y, m * N, mask0, acc0[m]);
    store(y, m * N + 16, mask1, acc1[m]);
  }
}

template <typename W, typename Y>
inline void rows_pass(int rows, const float* x, int64_t K, const W* panel, Y* y, int64_t N, int cols) {
  switch (rows) {
    case 1: panel_pass<1>(x, K, panel, y, N, cols); break;
    case 2: panel_pass<2>(x, K, panel, y, N, cols); break;
    case 3: panel_pass<3>(x, K, panel, y, N, cols); break;
    case 4: panel_pass<4>(x, K, panel, y, N, cols); break;
    case 5: panel_pass<5>(x, K, panel, y, N, cols); break;
    case 6: panel_pass<6>(x, K, panel, y, N, cols); break;
    case 7: panel_pass<7>(x, K, panel, y, N, cols); break;
    default: panel_pass<8>(x, K, panel, y, N, cols); break;
  }
}

template <typename W, typename Y>
void gemm(const float* x, int64_t M, int64_t K, const W* panels, int64_t N, Y* y, int threads) {
  const int64_t P = (N + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < P; ++p) {
    const W* panel = panels + p * K * kPanel;
    const int cols = static_cast<int>(N - p * kPanel < kPanel ? N - p * kPanel : kPanel);
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
      const int rows = static_cast<int>(M - m0 < kRowsPerPass ? M - m0 : kRowsPerPass);
      rows_pass(rows, x + m0 * K, K, panel, y + m0 * N + p * kPanel, N, cols);
    }
  }
}

}  // namespace

extern "C" {
int dspark_panel_width() { return kPanel; }

// x: M x K float32, or bfloat16 when x_bf16 (widened once here); panels bfloat16 when w_bf16;
// y: M x N, bfloat16 when y_bf16.
void dspark_panel_gemm(const void* x, int x_bf16, int64_t M, int64_t K, const void* panels, int w_bf16,
                       int64_t N, void* y, int y_bf16, int threads) {
  std::vector<float> widened;
  const float* xf = static_cast<const float*>(x);
  if (x_bf16) {
    widened.resize(static_cast<size_t>(M * K));
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    for (int64_t i = 0; i < M * K; ++i) {
      const uint32_t bits = static_cast<uint32_t>(xb[i]) << 16;
      std::memcpy(&widened[i], &bits, sizeof(float));
    }
    xf = widened.data();
  }
  if (w_bf16 && y_bf16) gemm(xf, M, K, static_cast<const uint16_t*>(panels), N, static_cast<uint16_t*>(y), threads);
  else if (w_bf16) gemm(xf, M, K, static_cast<const uint16_t*>(panels), N, static_cast<float*>(y), threads);
  else if (y_bf16) gemm(xf, M, K, static_cast<const float*>(panels), N, static_cast<uint16_t*>(y), threads);
  else gemm(xf, M, K, static_cast<const float*>(panels), N, static_cast<float*>(y), threads);
}
}
