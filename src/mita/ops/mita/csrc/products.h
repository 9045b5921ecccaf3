// Matrix products: the BLAS and brgemm calls (gemm), and register tiles for products too small for them.
// Part of the fused MiTA CPU kernel (fused_cpu.cpp, one translation unit; see README.md here).

#pragma once

#include "vec.h"

namespace {

#if defined(CPU_CAPABILITY_AVX512)
// Eight float lanes (a 256-bit register) where an AVX-512 build's vectors have 16: a small expert of
// at most 8 queries, its queries as the lanes of its scores, pads them to 8 instead of 16 and so pays
// half the multiply-adds and exponentials of its score product and softmax (N = 197: 61% of the
// experts, 7.9 queries on average). Never more instructions than 16 lanes; on a core that splits a
// 512-bit operation in two halves (AMD Zen 4) half the cycles.
struct Lanes8 {
  __m256 v;
  Lanes8() = default;
  Lanes8(__m256 x) : v(x) {}
  Lanes8(float x) : v(_mm256_set1_ps(x)) {}
  static constexpr int64_t size() { return 8; }
  static __mmask8 first(int64_t n) { return n >= 8 ? __mmask8(0xff) : __mmask8((1 << n) - 1); }
  static Lanes8 loadu(const float* p) { return _mm256_loadu_ps(p); }
  static Lanes8 loadu(const float* p, int64_t n) { return _mm256_maskz_loadu_ps(first(n), p); }
  // n <= 8 bfloat16 (a shift) or float16 (F16C) elements as floats, the missing lanes zero.
  static Lanes8 loadu(const c10::BFloat16* p, int64_t n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_maskz_loadu_epi16(first(n), p)), 16));
  }
  static Lanes8 loadu(const c10::Half* p, int64_t n) { return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(first(n), p)); }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(float* p, int64_t n) const { _mm256_mask_storeu_ps(p, first(n), v); }
  Lanes8 operator+(Lanes8 o) const { return _mm256_add_ps(v, o.v); }
  Lanes8 operator-(Lanes8 o) const { return _mm256_sub_ps(v, o.v); }
  Lanes8 operator*(Lanes8 o) const { return _mm256_mul_ps(v, o.v); }
  Lanes8 operator/(Lanes8 o) const { return _mm256_div_ps(v, o.v); }
  // exp and log by ATen's 16-lane functions on the zero-extended vector: the same values as 16 lanes.
  Lanes8 exp_u20() const { return _mm512_castps512_ps256(Vectorized<float>(_mm512_zextps256_ps512(v)).exp_u20()); }
  Lanes8 log() const { return _mm512_castps512_ps256(Vectorized<float>(_mm512_zextps256_ps512(v)).log()); }
};
inline Lanes8 vexp(Lanes8 x) { return x.exp_u20(); }
inline Lanes8 madd(Lanes8 a, Lanes8 b, Lanes8 c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }
inline Lanes8 lanes_max(Lanes8 a, Lanes8 b) {  // NaN propagates, as at::vec::maximum
  return _mm256_or_ps(_mm256_max_ps(a.v, b.v), _mm256_cmp_ps(a.v, b.v, _CMP_UNORD_Q));
}
inline Lanes8 prob(Lanes8 x, Lanes8 a, Lanes8 lse) {  // as vec.h's prob, NaN propagating as at::vec::minimum
  const Lanes8 d = x * a - lse;
  return vexp(_mm256_or_ps(_mm256_min_ps(d.v, _mm256_setzero_ps()), _mm256_cmp_ps(d.v, d.v, _CMP_UNORD_Q)));
}
#endif
template <typename T>
inline Vectorized<T> madd(const Vectorized<T>& a, const Vectorized<T>& b, const Vectorized<T>& c) {
  return at::vec::fmadd(a, b, c);
}
template <typename T>
inline Vectorized<T> lanes_max(const Vectorized<T>& a, const Vectorized<T>& b) {
  return at::vec::maximum(a, b);
}
// A small expert's n queries as the lanes of vectors V: `body` is called with a V, Lanes8 for up to
// 8 rows of float, bfloat16 or float16 (In, the rows' type) in an AVX-512 build, else Vectorized<T>.
template <typename T, typename In, typename F>
void with_lanes(int64_t n, const F& body) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float> && !std::is_same_v<In, double>)
    if (n <= Lanes8::size()) return body(Lanes8{});
#endif
  body(Vectorized<T>{});
}
// The row stride of n lanes in vectors V: whole vectors (padded_ld for Vectorized<T>), no masked loads.
template <typename T, typename V>
int64_t lanes_ld(int64_t n) {
  if constexpr (std::is_same_v<V, Vectorized<T>>) return padded_ld<T>(n);
  else return V::size();
}
// n <= V::size() elements of p as a vector V of T (Vectorized<T>: any input type; Lanes8: floats).
template <typename T, typename V, typename In>
inline V load_lanes(const In* p, int64_t n) {
  if constexpr (std::is_same_v<V, Vectorized<T>>) return load_as<T>(p, n);
  else return V::loadu(p, n);
}

// Products too small for a BLAS call to pay for itself (an expert of a few queries at vision
// sizes): C (M x N) = sum_l A(i, l) * row_l(B) (+ C when `add`), where A(i, l) = a(i)[l * as]
// and b(l) points to row l of B, so that either operand is read in place, transposed or
// gathered by index, without copies, in T or (the kernels' half-precision inputs) converted to T
// as it is loaded. Register tiles of R rows by NV vectors V (Vectorized<T>, or Lanes8),
// A broadcast.
template <typename T, typename V, int R, int NV, bool Full, typename AF, typename BF, typename CF>
void small_tile(int64_t i0, int64_t j0, int64_t K, int64_t last, const AF& a, int64_t as, const BF& b, const CF& c_row,
                bool add) {
  // U partial sums over l per output vector, so that a narrow tile (a leftover row) has enough
  // independent multiply-add chains in flight: with one chain each step waits the FMA's latency.
  constexpr int U = Full ? std::max(1, 8 / (R * NV)) : 1;
  V c[U][R][NV];
  decltype(a(i0)) ap[R];
  MITA_UNROLL for (int r = 0; r < R; ++r) ap[r] = a(i0 + r);
  MITA_UNROLL for (int u = 0; u < U; ++u)
    MITA_UNROLL for (int r = 0; r < R; ++r)
      MITA_UNROLL for (int v = 0; v < NV; ++v) c[u][r][v] = V(T(0));
  int64_t l = 0;
  for (; l + U <= K; l += U)
    MITA_UNROLL for (int u = 0; u < U; ++u) {
      const auto* row = b(l + u) + j0;
      V bv[NV];
      MITA_UNROLL for (int v = 0; v < NV; ++v)
        bv[v] = load_lanes<T, V>(row + v * V::size(), !Full && v == NV - 1 ? last : V::size());
      MITA_UNROLL for (int r = 0; r < R; ++r) {
        const V av(static_cast<T>(ap[r][(l + u) * as]));
        MITA_UNROLL for (int v = 0; v < NV; ++v) c[u][r][v] = madd(av, bv[v], c[u][r][v]);
      }
    }
  for (; l < K; ++l) {  // the last K % U steps (U > 1 only where the last vector is whole)
    const auto* row = b(l) + j0;
    MITA_UNROLL for (int r = 0; r < R; ++r) {
      const V av(static_cast<T>(ap[r][l * as]));
      MITA_UNROLL for (int v = 0; v < NV; ++v) c[0][r][v] = madd(av, load_lanes<T, V>(row + v * V::size(), V::size()), c[0][r][v]);
    }
  }
  MITA_UNROLL for (int u = 1; u < U; ++u)
    MITA_UNROLL for (int r = 0; r < R; ++r)
      MITA_UNROLL for (int v = 0; v < NV; ++v) c[0][r][v] = c[0][r][v] + c[u][r][v];
  MITA_UNROLL for (int r = 0; r < R; ++r)
    MITA_UNROLL for (int v = 0; v < NV; ++v) {
      T* p = c_row(i0 + r) + j0 + v * V::size();
      const int64_t n = v == NV - 1 ? last : V::size();
      const V out = add ? c[0][r][v] + V::loadu(p, n) : c[0][r][v];
      out.store(p, n);
    }
}

// small_tile with `last` fixed where it can be: a tile whose last vector is whole (every product
// of D = 64, and the lane-padded query columns) has no partial load in its loop, which let the
// compiler keep the accumulators in registers (measured 4-5% off the forward at N = 197, 1,025).
template <typename T, typename V, int R, int NV, typename AF, typename BF, typename CF>
void small_tile_any(int64_t i0, int64_t j0, int64_t K, int64_t last, const AF& a, int64_t as, const BF& b, const CF& c,
                    bool add) {
  if (last == V::size())
    small_tile<T, V, R, NV, true>(i0, j0, K, last, a, as, b, c, add);
  else
    small_tile<T, V, R, NV, false>(i0, j0, K, last, a, as, b, c, add);
}

// Rows of a matrix C with row stride ldc, as small_gemm's c.
template <typename T>
auto strided(T* C, int64_t ldc) {
  return [C, ldc](int64_t i) { return C + i * ldc; };
}

// The widest tile, in vectors: a 4 x kTileVectors tile of accumulators, its kTileVectors rows of B and
// one broadcast must fit the vector registers. AVX-512 has 32: 4 x 4 (21 live). AVX2 has 16, where
// 4 x 4 kept four accumulators on the stack (a load and a store around their multiply-adds in the
// compiled loop, Zen 3): 4 x 3 (16 live).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kTileVectors = 4;
#else
constexpr int kTileVectors = 3;
#endif

template <typename T, typename V, int R, typename AF, typename BF, typename CF>
void small_rows(int64_t nv, int64_t i0, int64_t j0, int64_t K, int64_t last, const AF& a, int64_t as, const BF& b,
                const CF& c, bool add) {
  switch (nv) {
    case 1: return small_tile_any<T, V, R, 1>(i0, j0, K, last, a, as, b, c, add);
    case 2: return small_tile_any<T, V, R, 2>(i0, j0, K, last, a, as, b, c, add);
    case 3: return small_tile_any<T, V, R, 3>(i0, j0, K, last, a, as, b, c, add);
    default:
      if constexpr (kTileVectors >= 4) return small_tile_any<T, V, R, 4>(i0, j0, K, last, a, as, b, c, add);
  }
}

// C (M x N) = A B (+ C when `add`) by register tiles of vectors V (Lanes8: floats); c(i) points to
// row i of C (rows in place or by index: a small expert's gradients added into the rows of its keys
// and queries, whose indices within an expert are distinct).
template <typename T, typename V = Vectorized<T>, typename AF, typename BF, typename CF>
void small_gemm(int64_t M, int64_t N, int64_t K, const AF& a, int64_t as, const BF& b, const CF& c, bool add = false) {
  constexpr int64_t W = V::size(), NV = kTileVectors;
  for (int64_t j0 = 0; j0 < N; j0 += NV * W) {
    const int64_t nv = std::min<int64_t>(NV, (N - j0 + W - 1) / W), last = std::min(W, N - j0 - (nv - 1) * W);
    int64_t i0 = 0;
    if (nv == 1)  // one vector a row: 8 rows keep 8 independent multiply-add chains in flight
      for (; i0 + 8 <= M; i0 += 8) small_tile_any<T, V, 8, 1>(i0, j0, K, last, a, as, b, c, add);
    for (; i0 + 4 <= M; i0 += 4) small_rows<T, V, 4>(nv, i0, j0, K, last, a, as, b, c, add);
    if (M - i0 >= 2) {
      small_rows<T, V, 2>(nv, i0, j0, K, last, a, as, b, c, add);
      i0 += 2;
    }
    if (M - i0 == 1) small_rows<T, V, 1>(nv, i0, j0, K, last, a, as, b, c, add);
  }
}

// Asks for a row gathered by index (an expert's keys, values, queries) ahead of its use: the
// hardware prefetcher cannot guess such rows (4-5% off the forward at N = 1,025 on the EPYC VM, 2%
// on the Xeon; in the backward, whose gathers are copies, it measured no gain). Only for heads
// whose keys take more than kPrefetchAbove bytes: at N = 197 (50 KB, the rows mostly still in L1
// from phase A) the forward ran 2-3% faster without.
constexpr int64_t kPrefetchAbove = int64_t(1) << 17;
// Locality 3 asks for the row into L1 (prefetcht0), 2 into L2 (prefetcht1).
template <typename T, int Locality = 3>
inline void prefetch_row(const T* row, int64_t D) {
  for (int64_t c = 0; c < D; c += 64 / int64_t(sizeof(T))) __builtin_prefetch(row + c, 0, Locality);
}

// The rows of one tensor read ahead: n rows of D elements, the first at `first`, st apart.
template <typename E>
struct AheadRows {
  const E* first;
  int64_t st, n;
};

// One core's L2 in bytes (sysconf's, else 512 KiB).
inline int64_t l2_bytes() {
#if defined(_SC_LEVEL2_CACHE_SIZE)
  static const int64_t bytes = std::max<int64_t>(sysconf(_SC_LEVEL2_CACHE_SIZE), 0);
  if (bytes > 0) return bytes;
#endif
  return int64_t(512) << 10;
}

// Part i of `parts` of reading the rows of `tensors` into L2 ahead of their use, while other work runs:
// a thread's next small head's rows during this head's routed phase (forward: q, k, v; backward: q,
// dout, out, k, v), if they fit in L2 together (N = 197 and 1,025 forward: 151 and 787 KB; 197
// backward: 252 KB). Their first reads came from memory (a head's pooling and phase A took 12% longer
// with 96 heads than with 8 at N = 197, the data no longer cached). Rows under a page apart (a head's
// rows its own pages) have part 0 first read a byte of each page: prefetches alone measured no gain
// (1.003 / 0.991 at N = 197 / 1,025, copies 1.001 / 0.994; our reading of a microbenchmark: a prefetch whose page
// translation is not cached is often dropped on Zen 4). Rows a page apart or more (timm's q, k, v,
// views of one qkv buffer) lie in pages the head before read too: reading them cost more than it
// saved (forward 1.04 of the time at N = 1,025, against 0.98 with prefetches alone). Into L2, not
// L1: with prefetcht0 the forward measured 1.011 against 0.944 at N = 197 (Zen 4).
//
// Whether it pays depends on the CPU (the forward at N = 197 with it took 0.91-0.96 of the time on
// Zen 4, 1.02-1.03 on an Intel Xeon without AMX), so torch.ops.mita.read_ahead switches it per
// process, as fused.read_ahead measures once.
inline std::atomic<bool>& read_ahead_on() {
  static std::atomic<bool> on{true};
  return on;
}
template <typename E>
void read_ahead(std::initializer_list<AheadRows<E>> tensors, int64_t D, int64_t i, int64_t parts) {
  int64_t bytes = 0;
  for (const auto& t : tensors) bytes += t.n * D * int64_t(sizeof(E));
  if (bytes > l2_bytes() || !read_ahead_on().load(std::memory_order_relaxed)) return;
  for (const auto& [first, st, n] : tensors) {
    const auto touch = [](const E* p) { (void)*reinterpret_cast<const volatile char*>(p); };
    if (i == 0 && st * int64_t(sizeof(E)) < 4096) {  // row starts a page apart (st >= D: fused_cpu.cpp), the last row's end
      for (int64_t r = 0; r < n; r += 4096 / (st * int64_t(sizeof(E)))) touch(first + r * st);
      touch(first + (n - 1) * st + D - 1);
    }
    for (int64_t r = i * n / parts; r < (i + 1) * n / parts; ++r) prefetch_row<E, 2>(first + r * st, D);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// 16 vectors of 16 floats transposed in registers, r[i][j] <- r[j][i]: the off-diagonal b x b
// blocks swapped for b = 8, 4, 2, 1, each step 16 two-source permutes.
inline void transpose_block(Vectorized<float> r[16]) {
  constexpr auto table = [](int b, bool high) {
    std::array<int32_t, 16> t{};
    for (int L = 0; L < 16; ++L) {
      const int g = L / (2 * b) * 2 * b, p = L % (2 * b);
      t[L] = high ? (p < b ? g + p + b : 16 + g + p) : (p < b ? g + p : 16 + g + p - b);
    }
    return t;
  };
  static constexpr std::array<std::array<int32_t, 16>, 8> idx = {table(8, false), table(8, true), table(4, false),
                                                                  table(4, true),  table(2, false), table(2, true),
                                                                  table(1, false), table(1, true)};
  MITA_UNROLL for (int s = 0; s < 4; ++s) {
    const int b = 8 >> s;
    const __m512i lo = _mm512_loadu_si512(idx[2 * s].data()), hi = _mm512_loadu_si512(idx[2 * s + 1].data());
    MITA_UNROLL for (int i = 0; i < 16; ++i)
      if (!(i & b)) {
        const __m512 a = r[i], c = r[i + b];
        r[i] = _mm512_permutex2var_ps(a, lo, c);
        r[i + b] = _mm512_permutex2var_ps(a, hi, c);
      }
  }
}
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// 8 vectors of 8 floats transposed in registers, r[i][j] <- r[j][i]: pairs of rows interleaved,
// then pairs of pairs (columns c and c + 4 of four rows), then the 128-bit halves exchanged.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4)
    for (int j = 0; j < 2; ++j) {
      u[i + 2 * j] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], _MM_SHUFFLE(1, 0, 1, 0));
      u[i + 2 * j + 1] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], _MM_SHUFFLE(3, 2, 3, 2));
    }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
  }
}
#endif
#if defined(CPU_CAPABILITY_AVX512)
inline void transpose_block(Lanes8 r[8]) { transpose8(reinterpret_cast<__m256*>(r)); }
#elif defined(CPU_CAPABILITY_AVX2)
inline void transpose_block(Vectorized<float> r[8]) { transpose8(reinterpret_cast<__m256*>(r)); }
#endif

// Qt (D x ld) = scale * the rows row(0 .. nb) as its columns, columns nb .. ld zero (a small
// expert's queries as lanes; an operand of gemm transposed); rows of T or of half precision. With AVX-512 or AVX2 by square blocks
// transposed in registers (a partial block's missing rows loaded as zeros, its missing columns not
// stored): the element-wise stores were a fifth of the routed phase at N = 197.
template <typename T, typename V = Vectorized<T>, typename RF>
void rows_as_columns(int64_t nb, int64_t D, int64_t ld, T scale, const RF& row, T* Qt) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    constexpr int W = V::size();
    const V vs(scale);
    for (int64_t i0 = 0; i0 < ld; i0 += W) {
      decltype(row(0)) rp[W];
      MITA_UNROLL for (int i = 0; i < W; ++i) rp[i] = i0 + i < nb ? row(i0 + i) : nullptr;
      for (int64_t d0 = 0; d0 < D; d0 += W) {
        const int64_t n = std::min<int64_t>(W, D - d0);
        V r[W];
        MITA_UNROLL for (int i = 0; i < W; ++i)
          r[i] = rp[i] ? load_lanes<T, V>(rp[i] + d0, n) * vs : V(0.f);
        transpose_block(r);
        // A whole block's stores apart from a partial one's: GCC turned the one loop of both into
        // a copy of r through the stack (`rep movsq`, a sixth of the routed phase at N = 197).
        if (n == W) {
          MITA_UNROLL for (int c = 0; c < W; ++c) r[c].store(Qt + (d0 + c) * ld + i0);
        } else {
          for (int c = 0; c < n; ++c) r[c].store(Qt + (d0 + c) * ld + i0);
        }
      }
    }
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) std::fill(Qt + d * ld + nb, Qt + (d + 1) * ld, T(0));
  for (int64_t i = 0; i < nb; ++i) {
    const auto* q = row(i);
    for (int64_t d = 0; d < D; ++d) Qt[d * ld + i] = scale * static_cast<T>(q[d]);
  }
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// C (cols x rows, row stride ldc) = X^T (+ C when `add`) for X (rows x cols, row stride ldx): square
// blocks transposed in registers, the edges loaded and stored partially.
inline void transpose_into(const float* X, int64_t rows, int64_t cols, int64_t ldx, float* C, int64_t ldc, bool add) {
  using V = Vectorized<float>;
  constexpr int W = V::size();
  for (int64_t j0 = 0; j0 < rows; j0 += W) {
    const int64_t nr = std::min<int64_t>(W, rows - j0);
    for (int64_t i0 = 0; i0 < cols; i0 += W) {
      const int64_t nc = std::min<int64_t>(W, cols - i0);
      V r[W];
      MITA_UNROLL for (int w = 0; w < W; ++w) r[w] = w < nr ? V::loadu(X + (j0 + w) * ldx + i0, nc) : V(0.f);
      transpose_block(r);
      const auto put = [&](int c) {
        float* out = C + (i0 + c) * ldc + j0;
        (add ? r[c] + V::loadu(out, nr) : r[c]).store(out, nr);
      };
      if (nc == W) {
        MITA_UNROLL for (int c = 0; c < W; ++c) put(c);
      } else {
        for (int c = 0; c < nc; ++c) put(c);
      }
    }
  }
}
#endif

// Row-major C (M x N) = op(A) op(B) (+ C when `add`), op(A) is M x K, op(B) is K x N. Floats go
// to ATen's brgemm (oneDNN's JIT micro-kernels where the CPU has them, else the BLAS), a transposed
// operand first transposed into scratch: on AMD Zen 5 it ran these products 2.4-3.5x faster than
// MKL's sgemm, which takes its AVX2 code on AMD CPUs (single calls, one thread, the shapes of N = 197
// to 16,384). Doubles (and floats with a torch older than float brgemm) go to the BLAS that
// libtorch_cpu links, which as column-major sees the transposes: C^T = op(B)^T op(A)^T.
template <typename T>
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb,
          bool add, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
#if defined(CPUBLAS_BRGEMM_F32F32F32)
  if constexpr (std::is_same_v<T, float>) {
    thread_local std::vector<float> a_t, b_t;
    // X (rows x cols, row stride ld) as its transpose in buf; ld becomes the transpose's row stride.
    const auto transposed = [](const float* X, int64_t rows, int64_t cols, int64_t& ld, std::vector<float>& buf) {
      const int64_t out = padded_ld<float>(rows);
      buf.resize(cols * out);
      rows_as_columns(rows, cols, out, 1.f, [&](int64_t i) { return X + i * ld; }, buf.data());
      ld = out;
      return static_cast<const float*>(buf.data());
    };
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if (tb && !ta && 5 * M * (K + N) < 3 * N * K) {
      // C = A B^T as (B A^T)^T where A and the product are the smaller transposes, by 0.6 or less in
      // elements: landmarks against keys or queries when m is well below D (m = 25 at D = 64: the
      // forward 3-4% faster at N = 197, Zen 3; at m = 49, 0.86-0.96 of the elements, 2-3% slower).
      thread_local std::vector<float> c_t;
      A = transposed(A, M, K, lda, a_t);  // A^T, K x M, lda = M padded
      c_t.resize(N * lda);
      at::native::cpublas::brgemm(N, M, K, ldb, lda, lda, false, B, A, c_t.data(), false);
      transpose_into(c_t.data(), N, M, lda, C, ldc, add);
      return;
    }
#endif
    if (ta) A = transposed(A, K, M, lda, a_t);  // A is stored K x M
    if (tb) B = transposed(B, N, K, ldb, b_t);  // B is stored N x K
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, false);
    return;
  }
#endif
  const char a = ta ? 'T' : 'N', b = tb ? 'T' : 'N';
  const int m = N, n = M, k = K, la = ldb, lb = lda, lc = ldc;
  const T one = 1, beta = add ? 1 : 0;
  if constexpr (std::is_same_v<T, float>) {
    sgemm_(&b, &a, &m, &n, &k, &one, B, &la, A, &lb, &beta, C, &lc);
  } else {
    dgemm_(&b, &a, &m, &n, &k, &one, B, &la, A, &lb, &beta, C, &lc);
  }
}

// bfloat16 products (issue 29). Where the CPU multiplies bfloat16 in hardware (AVX512-BF16's
// vdpbf16ps, AMX's tiles: fused.bf16_products), fused.py defines MITA_BF16_PRODUCTS and
// the forward of bfloat16 inputs computes its products on large heads (the gate's Q L^T and G V_S,
// the experts' scores and P V_e; a small head's small experts keep float32 register tiles), and the
// backward of a large head its score products (backward.h), from bfloat16 operands with float32
// accumulation through ATen's brgemm (oneDNN's JIT micro-kernels) instead of converting its blocks
// to float32: on a Zen 4 core, single products of the kernel's shapes (M, N = 25-256, K = 64-256)
// ran 1.8-2.0x faster than float32 brgemm. brgemm takes B in the VNNI layout: rows 2p and 2p + 1
// interleaved element by element, (K / 2) x N x 2, which the two packers below write. K must be
// even: an odd K is padded with a zero row of B and a zero column of A (the A operands copied here
// are; one read in place needs an even D).
using bf16 = c10::BFloat16;
#if defined(MITA_BF16_PRODUCTS) && defined(CPU_CAPABILITY_AVX512)
constexpr bool kBf16Products = true;

// B (K x N, K even) with element (k, n) = col(n)[k], as VNNI into out: a pair (k, k + 1) of
// column n is one 32-bit word of col(n) and goes to word (k / 2) * N + n of out, so this is a
// transpose of 32-bit words, by the float transposes of 16 x 16 blocks (bits moved, not converted).
template <typename CF>
void vnni_from_columns(int64_t K, int64_t N, const CF& col, bf16* out) {
  using V = Vectorized<float>;
  constexpr int W = V::size();
  const int64_t words = K / 2;
  float* o = reinterpret_cast<float*>(out);
  for (int64_t n0 = 0; n0 < N; n0 += W) {
    const int64_t nn = std::min<int64_t>(W, N - n0);
    const float* c[W];
    MITA_UNROLL for (int i = 0; i < W; ++i) c[i] = i < nn ? reinterpret_cast<const float*>(col(n0 + i)) : nullptr;
    for (int64_t p0 = 0; p0 < words; p0 += W) {
      const int64_t np = std::min<int64_t>(W, words - p0);
      V r[W];
      MITA_UNROLL for (int i = 0; i < W; ++i) r[i] = c[i] ? V::loadu(c[i] + p0, np) : V(0.f);
      transpose_block(r);
      if (np == W) {
        MITA_UNROLL for (int j = 0; j < W; ++j) r[j].store(o + (p0 + j) * N + n0, nn);
      } else {
        for (int j = 0; j < np; ++j) r[j].store(o + (p0 + j) * N + n0, nn);
      }
    }
  }
}

// B (K x N) with element (k, n) = row(k)[n] (bfloat16 rows), as VNNI into out, K rounded up to
// even with a zero row: each pair of rows interleaved 32 columns at a time by two 16-bit permutes.
template <typename RF>
void vnni_from_rows(int64_t K, int64_t N, const RF& row, bf16* out) {
  alignas(64) static constexpr auto idx = [] {
    std::array<int16_t, 64> t{};
    for (int i = 0; i < 32; ++i) {
      t[2 * (i % 16) + 32 * (i / 16)] = int16_t(i % 16 + 16 * (i / 16));
      t[2 * (i % 16) + 1 + 32 * (i / 16)] = int16_t(32 + i % 16 + 16 * (i / 16));
    }
    return t;
  }();
  const __m512i lo = _mm512_load_si512(idx.data()), hi = _mm512_load_si512(idx.data() + 32);
  for (int64_t k = 0; k < K; k += 2) {
    const bf16 *a = row(k), *b = k + 1 < K ? row(k + 1) : nullptr;
    bf16* o = out + k * N;
    for (int64_t n0 = 0; n0 < N; n0 += 32) {
      const int64_t nn = std::min<int64_t>(32, N - n0);
      const __mmask32 in = nn == 32 ? ~__mmask32(0) : (__mmask32(1) << nn) - 1;
      const __m512i x = _mm512_maskz_loadu_epi16(in, a + n0);
      const __m512i y = b ? _mm512_maskz_loadu_epi16(in, b + n0) : _mm512_setzero_si512();
      const int64_t first = std::min<int64_t>(32, 2 * nn), second = 2 * nn - first;
      _mm512_mask_storeu_epi16(o + 2 * n0, first == 32 ? ~__mmask32(0) : (__mmask32(1) << first) - 1,
                               _mm512_permutex2var_epi16(x, lo, y));
      if (second > 0)
        _mm512_mask_storeu_epi16(o + 2 * n0 + 32, second == 32 ? ~__mmask32(0) : (__mmask32(1) << second) - 1,
                                 _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

// dst (n rows of ld >= K + K % 2, bfloat16) = src (n rows of K floats, ld_src apart), rounded to
// nearest even, a zero column appended where K is odd. A float operand (probabilities, landmarks).
inline void rows_to_bf16(const float* src, int64_t n, int64_t K, int64_t ld_src, bf16* dst, int64_t ld) {
  for (int64_t i = 0; i < n; ++i) {
    at::vec::convert(src + i * ld_src, dst + i * ld, K);
    if (K % 2) dst[i * ld + K] = bf16(0.f);
  }
}

// 16 floats as 16 bfloat16 (rounded to nearest even, NaN kept a quiet NaN), as at::vec::convert
// rounds, in registers.
inline __m512i round_bf16(__m512i b) {  // float bits rounded to their upper 16 bits, to nearest even
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), odd),
                          _mm512_set1_epi32(int32_t(0xFFFF0000u)));
}
inline __m256i to_bf16(__m512 x) {
  const __m512i h = _mm512_srli_epi32(round_bf16(_mm512_castps_si512(x)), 16);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), h, _mm512_set1_epi32(0x7FC0)));
}

// x as hi + lo, both bfloat16: hi = x rounded to nearest even, lo = the remainder (exact in float32)
// rounded, so hi + lo holds x to about 2^-17 relative. A product taken as hi B + lo B is then as
// accurate as a float32 one where B is exact in bfloat16 (values of bfloat16 inputs). Finite x.
inline void split_bf16(const float* src, int64_t K, bf16* hi, bf16* lo) {
  for (int64_t j = 0; j < K; j += 16) {
    const __mmask16 in = K - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - j)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(in, src + j);
    const __m512i h = round_bf16(_mm512_castps_si512(x));
    _mm256_mask_storeu_epi16(hi + j, in, _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
    _mm256_mask_storeu_epi16(lo + j, in, to_bf16(_mm512_sub_ps(x, _mm512_castsi512_ps(h))));
  }
}

// dst (K rows of ld >= n + n % 2, bfloat16) = src^T rounded, for src n rows of K floats (ld_src
// apart), a zero column appended where n is odd: a transposed A operand (P^T, dS^T against rows of
// queries or keys), by 16 x 16 blocks transposed in registers.
inline void columns_to_bf16(const float* src, int64_t n, int64_t K, int64_t ld_src, bf16* dst, int64_t ld) {
  using V = Vectorized<float>;
  constexpr int W = V::size();
  const int64_t n2 = n + n % 2;
  for (int64_t i0 = 0; i0 < n2; i0 += W) {
    const int64_t nr = std::min<int64_t>(W, n - i0);
    const __mmask16 out = __mmask16((1u << std::min<int64_t>(W, n2 - i0)) - 1);
    for (int64_t k0 = 0; k0 < K; k0 += W) {
      const int64_t nc = std::min<int64_t>(W, K - k0);
      V r[W];
      MITA_UNROLL for (int w = 0; w < W; ++w) r[w] = w < nr ? V::loadu(src + (i0 + w) * ld_src + k0, nc) : V(0.f);
      transpose_block(r);
      for (int64_t c = 0; c < nc; ++c) _mm256_mask_storeu_epi16(dst + (k0 + c) * ld + i0, out, to_bf16(r[c]));
    }
  }
}

// C (M x N, row stride ldc) = A B (+ C when `add`): A bfloat16 rows (lda apart), B as VNNI of K2
// (even) rows by N columns.
inline void gemm_bf16(int64_t M, int64_t N, int64_t K2, const bf16* A, int64_t lda, const bf16* B, bool add, float* C,
                      int64_t ldc) {
  if (M > 0 && N > 0) at::native::cpublas::brgemm(M, N, K2, lda, N, ldc, add, A, B, C, true);
}

// Whether brgemm takes bfloat16 VNNI operands now: torch routes them to oneDNN only while oneDNN is
// enabled (`torch.backends.mkldnn.flags(enabled=False)` turns it off, and brgemm would then refuse
// them), so each call of the kernels asks once and otherwise takes their float32 path.
inline bool products_allowed() { return at::globalContext().userEnabledMkldnn(); }

// Releases what brgemm set up on this thread (AMX's tile configuration), as PyTorch's CPU flash
// attention does after its loops.
struct Bf16Products {
  ~Bf16Products() { at::native::cpublas::brgemm_release(true); }
};
#else  // declared for the branches `if constexpr (kBf16Products)` discards
constexpr bool kBf16Products = false;
template <typename CF>
void vnni_from_columns(int64_t K, int64_t N, const CF& col, bf16* out);
template <typename RF>
void vnni_from_rows(int64_t K, int64_t N, const RF& row, bf16* out);
void rows_to_bf16(const float* src, int64_t n, int64_t K, int64_t ld_src, bf16* dst, int64_t ld);
void split_bf16(const float* src, int64_t K, bf16* hi, bf16* lo);
void columns_to_bf16(const float* src, int64_t n, int64_t K, int64_t ld_src, bf16* dst, int64_t ld);
void gemm_bf16(int64_t M, int64_t N, int64_t K2, const bf16* A, int64_t lda, const bf16* B, bool add, float* C,
               int64_t ldc);
inline bool products_allowed() { return false; }
struct Bf16Products {};
#endif

// Up to this many multiply-adds (queries x keys x D) an expert's products skip BLAS: in the
// forward up to 2^20 (2^17: 2-9% slower at N = 1,025-4,096; no limit: 1.5-1.8% slower at 16,384 and
// 65,536), in the backward up to 2^17 (2^19: 9% slower at N = 4,096).
constexpr int64_t kSmallForward = int64_t(1) << 20, kSmallBackward = int64_t(1) << 17;

}  // namespace
