// y[M,N] = x[M,K] @ W[N,K]^T for small M, with W packed once into 32-column panels [P][K][32]
// (float32, or bfloat16 widened to float32 in registers). Each panel is streamed from memory once
// per call and reused from cache for every pass of rows (8 rows with AVX-512; with AVX2, which has
// half the registers, 4, or 6 over half a panel: see `gemm`), so a few rows cost about what one costs.
// Every output element sums over k in the same order whatever M is: a row's result does not
// depend on the rows beside it (a verify window reproduces the one-token decode bit for bit).
// On a CPU with AMX (built with -march=native there), bfloat16 weights whose K is a multiple of 32
// are packed instead as [P][K/2][32][2] (pairs of consecutive k per column) and multiplied on the tiles:
// 16 rows x 32 columns per pass, k in steps of 32. Each output element still sums over k in the
// same order whatever M is, so rows stay independent of each other.
// On a CPU with AVX512-BF16 but no AMX (an AMD EPYC Zen 4, built with -march=native there), the same
// pair layout is multiplied in registers by VDPBF16PS: 8 rows x 32 columns a pass, one instruction
// per 16 columns and 2 k, where the widening kernel above spends two FMAs and two widening ops. A
// pair's products are summed in one fixed order per output element (DAZ/FTZ, as the instruction
// does), the same for every row count: rows stay independent of each other here too.
#include <stdint.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define DSPARK_AMX 1
#endif

namespace {

constexpr int kPanel = 32;        // output columns per panel: two 16-lane vectors
constexpr int kPrefetchRows = 32; // prefetch this many panel rows (k) ahead

// Columns [col0, col0 + 16 * V) of up to M rows of x against one panel; `cols` counts the panel's
// real columns from col0 (the last panel of a matrix can be narrower).
template <int M, int V, typename W, typename Y>
inline void panel_pass(const float* x, int64_t K, const W* panel, int col0, Y* y, int64_t N, int cols) {
  vec16 acc[V][M];
  for (int v = 0; v < V; ++v)
    for (int m = 0; m < M; ++m) acc[v][m] = vzero();
  const W* weights = panel + col0;
  for (int64_t k = 0; k < K; ++k) {
    if (col0 == 0) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchRows) * kPanel), _MM_HINT_T0);
    vec16 w[V];
    for (int v = 0; v < V; ++v) w[v] = vload(weights + k * kPanel + 16 * v);  // bfloat16 is widened
    for (int m = 0; m < M; ++m) {
      const vec16 xb = vset1(x[m * K + k]);
      for (int v = 0; v < V; ++v) acc[v][m] = vfmadd(xb, w[v], acc[v][m]);
    }
  }
  for (int v = 0; v < V; ++v) {
    const lanemask mask = first_lanes(cols - 16 * v);
    for (int m = 0; m < M; ++m) vstore_masked(y + m * N + col0 + 16 * v, mask, acc[v][m]);
  }
}

// Call `pass` with std::integral_constant<int, rows> for `rows` in 1..R: each row count gets the pass
// compiled for exactly that many, none for more than R.
template <int R, typename Pass>
inline void with_rows(int rows, Pass&& pass) {
  if constexpr (R > 1) {
    if (rows < R) return with_rows<R - 1>(rows, pass);
  }
  pass(std::integral_constant<int, R>{});
}

// R rows at a time over 16 * V columns of each panel; a panel is read from memory by its first
// pass and from cache by the others. Panels are handed out one at a time (dynamic): on a 2-core
// server the tokenizer and detokenizer processes take a core now and then, and with a static
// split the call waited for the descheduled thread's half. Which thread multiplies a panel does
// not change its bits. Served at concurrency 16 on the AVX2 CPU, decode steps' linears took
// 49.7 ms against 53.2 static (steps right after a request joined, 71.8 against 94.3).
template <int V, int R, typename W, typename Y>
void gemm_passes(const float* x, int64_t M, int64_t K, const W* panels, int64_t N, Y* y, int threads) {
  const int64_t P = (N + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t p = 0; p < P; ++p) {
    const W* panel = panels + p * K * kPanel;
    const int cols = static_cast<int>(N - p * kPanel < kPanel ? N - p * kPanel : kPanel);
    for (int col0 = 0; col0 < cols; col0 += 16 * V)
      for (int64_t m0 = 0; m0 < M; m0 += R) {
        const int rows = static_cast<int>(M - m0 < R ? M - m0 : R);
        with_rows<R>(rows, [&](auto m) {
          panel_pass<decltype(m)::value, V>(x + m0 * K, K, panel, col0, y + m0 * N + p * kPanel, N, cols - col0);
        });
      }
  }
}

// AVX-512: 8 rows x 32 columns a pass (16 zmm accumulators). AVX2, where a 16-lane vector is two
// ymm, has half the registers: whole panels 4 rows a pass (16 ymm of accumulators, some spilt to L1)
// up to kWholePanelMaxRows rows, beyond that 16-column halves 6 rows a pass (12 ymm, none spilt).
// Halves lose below ~12 rows (the second half re-reads the panel from L2), and whole panels 3 rows a
// pass (no spill) lost everywhere (twice the passes); the timings are in panel_gemm.py.
constexpr int kWholePanelMaxRows = 12;

template <typename W, typename Y>
void gemm(const float* x, int64_t M, int64_t K, const W* panels, int64_t N, Y* y, int threads) {
  if (kAvx512) gemm_passes<2, 8>(x, M, K, panels, N, y, threads);
  else if (M <= kWholePanelMaxRows) gemm_passes<2, 4>(x, M, K, panels, N, y, threads);
  else gemm_passes<1, 6>(x, M, K, panels, N, y, threads);
}

#ifdef DSPARK_AMX
constexpr int kTileK = 32;     // bf16 values of k per tile multiply
constexpr int kTileRows = 16;  // rows of x per tile pass

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands out the tile registers only on request (once per process).
bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

// Tiles 0, 1: the accumulators of columns 0-15 and 16-31; 2: x; 3, 4: the weight pairs.
void configure_tiles(int rows) {
  TileConfig config = {};
  config.palette_id = 1;
  for (int t = 0; t < 5; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = static_cast<uint8_t>(t < 3 ? rows : kTileK / 2);
  }
  _tile_loadconfig(&config);
}

inline void store_row(const float* acc, uint16_t* y, int cols) {
  vstore_masked(y, first_lanes(cols), vload(acc));
  vstore_masked(y + 16, first_lanes(cols - 16), vload(acc + 16));
}

// x: M x K bfloat16, K a multiple of kTileK; panels [P][K/2][32][2]; y: M x N bfloat16.
void amx_gemm(const uint16_t* x, int64_t M, int64_t K, const uint16_t* panels, int64_t N, uint16_t* y, int threads) {
  const int64_t P = (N + kPanel - 1) / kPanel;
#pragma omp parallel num_threads(threads)
  {
    alignas(64) float acc[kTileRows * kPanel];
    int configured = -1;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < P; ++p) {
      const uint16_t* panel = panels + p * K * kPanel;
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        if (rows != configured) {
          configure_tiles(rows);
          configured = rows;
        }
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k = 0; k < K; k += kTileK) {
          _tile_loadd(2, x + m0 * K + k, K * 2);
          _tile_loadd(3, panel + k * kPanel, kPanel * 4);
          _tile_loadd(4, panel + k * kPanel + kPanel, kPanel * 4);
          _tile_dpbf16ps(0, 2, 3);
          _tile_dpbf16ps(1, 2, 4);
        }
        _tile_stored(0, acc, kPanel * 4);
        _tile_stored(1, acc + 16, kPanel * 4);
        for (int m = 0; m < rows; ++m) store_row(acc + m * kPanel, y + (m0 + m) * N + p * kPanel, cols);
      }
    }
    if (configured >= 0) _tile_release();
  }
}
#endif

#ifdef __AVX512BF16__
#define DSPARK_DPBF16 1
constexpr int kPairRows = 8;  // rows a pass: 16 zmm accumulators

// Up to M rows of x (bfloat16, M x K) against one pair panel [K/2][32][2]; y: bfloat16.
template <int M>
inline void pair_pass(const uint16_t* x, int64_t K, const uint16_t* panel, uint16_t* y, int64_t N, int cols) {
  __m512 acc[2][M];
  for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const uint16_t* ahead = panel + (k + 2 * kPrefetchRows) * kPanel;  // two cache lines a pair
    _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(ahead + kPanel), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + k * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + k * kPanel + kPanel);
    for (int m = 0; m < M; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + k, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], xb, w0);
      acc[1][m] = _mm512_dpbf16_ps(acc[1][m], xb, w1);
    }
  }
  for (int m = 0; m < M; ++m) {
    vstore_masked(y + m * N, first_lanes(cols), acc[0][m]);
    vstore_masked(y + m * N + 16, first_lanes(cols - 16), acc[1][m]);
  }
}

// x: M x K bfloat16, K even; panels [P][K/2][32][2]; y: M x N bfloat16. Panels handed out as in
// `gemm_passes`.
void dpbf16_gemm(const uint16_t* x, int64_t M, int64_t K, const uint16_t* panels, int64_t N, uint16_t* y,
                 int threads) {
  const int64_t P = (N + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t p = 0; p < P; ++p) {
    const uint16_t* panel = panels + p * K * kPanel;
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - p * kPanel));
    for (int64_t m0 = 0; m0 < M; m0 += kPairRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kPairRows, M - m0));
      with_rows<kPairRows>(rows, [&](auto m) {
        pair_pass<decltype(m)::value>(x + m0 * K, K, panel, y + m0 * N + p * kPanel, N, cols);
      });
    }
  }
}
#endif

}  // namespace

extern "C" {
// 1 when this build multiplies pair panels with VDPBF16PS (`dspark_panel_gemm_dpbf16`).
int dspark_dpbf16_panels() {
#ifdef DSPARK_DPBF16
  return 1;
#else
  return 0;
#endif
}

// The AMX layout and contract, in AVX512-BF16 registers: returns 0; -1 where this build has no
// VDPBF16PS, -2 for a K that is not a multiple of 32 (the layout the tiles share).
int dspark_panel_gemm_dpbf16(const void* x, int64_t M, int64_t K, const void* panels, int64_t N, void* y,
                             int threads) {
#ifdef DSPARK_DPBF16
  if (K % 32 != 0) return -2;
  dpbf16_gemm(static_cast<const uint16_t*>(x), M, K, static_cast<const uint16_t*>(panels), N,
              static_cast<uint16_t*>(y), threads);
  return 0;
#else
  (void)x; (void)M; (void)K; (void)panels; (void)N; (void)y; (void)threads;
  return -1;
#endif
}

// 1 when bfloat16 weights go through the tiles (pack them with `dspark_panel_gemm_amx`'s layout).
int dspark_amx_panels() {
#ifdef DSPARK_AMX
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// x: M x K bfloat16, K a multiple of 32; panels [P][K/2][32][2] bfloat16; y: M x N bfloat16.
// Returns 0; -1 where the tiles are not available, -2 for a K the tiles cannot step over.
int dspark_panel_gemm_amx(const void* x, int64_t M, int64_t K, const void* panels, int64_t N, void* y, int threads) {
#ifdef DSPARK_AMX
  if (!amx_permitted()) return -1;
  if (K % kTileK != 0) return -2;
  amx_gemm(static_cast<const uint16_t*>(x), M, K, static_cast<const uint16_t*>(panels), N, static_cast<uint16_t*>(y),
           threads);
  return 0;
#else
  (void)x; (void)M; (void)K; (void)panels; (void)N; (void)y; (void)threads;
  return -1;
#endif
}

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
