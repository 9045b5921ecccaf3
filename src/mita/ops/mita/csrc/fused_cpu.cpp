// Fused MiTA on CPU, forward and backward (training and inference): the algorithm of grouped.py, block by block in cache.
//
// Per head x = (b, h), with L the landmarks, s0 = scale, ls = landmark_scale:
//   A (shared expert and experts): for key blocks, S = L K^T; a streaming top-k per landmark
//     row, and an online softmax of s0*S accumulated into V~ = softmax(s0 L K^T) V.
//   B (gate and shared branch): for query blocks, G = Q L^T; routes = top-s of G; the shared
//     partial softmax of ls*G gives out = softmax(ls G) V~ and its log-sum-exp.
//   C (routed branch): queries grouped by expert (counting sort); per expert, its keys and
//     values are gathered once and its queries, in blocks, attend to them (softmax + lse).
//   Merge: the routed and shared partial softmaxes weighted by the softmax of their
//     log-sum-exps, which is exactly the one joint softmax of step 6.
// The per-head matrix products go to ATen's brgemm (floats) or the BLAS (doubles), see gemm; the
// small experts' products, with rows gathered by index, run in register tiles (small_gemm);
// element-wise work uses ATen's vectorized types. Ties in top-k and routing go to the lower index.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <functional>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
            const int*, const double*, const int*, const double*, double*, const int*);
}

namespace {

using at::vec::Vectorized;

// MKL (which PyTorch links on x86) may start threads of its own for a product called inside
// a parallel region: measured 30% slower at N = 197. Keep each product on its calling thread.
// The symbol is weak: with another BLAS it is null and nothing is done.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
struct SingleThreadedBlas {
  int previous = MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0;
  ~SingleThreadedBlas() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(previous);
  }
};

template <typename T>
inline Vectorized<T> vexp(const Vectorized<T>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

template <typename T>
T row_max(const T* x, int64_t n) {  // NaN propagates; the tail is one partial vector (rows are short)
  using V = Vectorized<T>;
  const V ninf(-std::numeric_limits<T>::infinity());
  V vm = ninf;
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) vm = at::vec::maximum(vm, V::loadu(x + j));
  if (j < n) vm = at::vec::maximum(vm, V::set(ninf, V::loadu(x + j, n - j), n - j));
  return at::vec::vec_reduce_all<T>([](V& p, V& q) { return at::vec::maximum(p, q); }, vm);
}

// x <- exp(a * (x - mx)) in place, for a > 0 and mx the max of x (or above it); returns the sum.
// The difference is scaled, not a * x - a * mx: the compiler may fuse that into one multiply-add,
// whose exact a * x less the rounded a * mx is up to half an ulp of a * mx above 0 at the max, so
// that once a * mx passes 2^31 in float (2^63 in double) its exponential overflows and the row
// turns NaN. x - mx is never above 0, so neither is the argument, whatever the magnitudes.
template <typename T>
T exp_sum(T* x, int64_t n, T a, T mx) {
  using V = Vectorized<T>;
  const V va(a), vm(mx), zero(T(0));
  V vs = zero;
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V e = vexp((V::loadu(x + j) - vm) * va);
    e.store(x + j);
    vs = vs + e;
  }
  if (j < n) {
    const V e = V::set(zero, vexp((V::loadu(x + j, n - j) - vm) * va), n - j);
    e.store(x + j, n - j);
    vs = vs + e;
  }
  return at::vec::vec_reduce_all<T>([](V& p, V& q) { return p + q; }, vs);
}

template <typename T>
void scale_row(T* x, int64_t n, T a) {
  at::vec::map([a](Vectorized<T> v) { return v * Vectorized<T>(a); }, x, x, n);
}

// x <- exp(a * (x - max x)) in place, a > 0; returns (sum, a * max x), the max of the logits a * x.
template <typename T>
std::pair<T, T> exp_row(T* x, int64_t n, T a) {
  const T mx = row_max(x, n);
  return {exp_sum(x, n, a, mx), a * mx};
}

// A probability from its logit a * x and its softmax's log-sum-exp (the backward's recomputation):
// exp(min(a * x - lse, 0)). A probability is at most 1; the min keeps it so where rounding (of lse,
// or of a multiply-add the compiler fuses) puts the difference above 0, by up to half an ulp of lse,
// which past 2^31 in float (2^63 in double) would overflow the exponential.
template <typename T>
inline Vectorized<T> prob(const Vectorized<T>& x, const Vectorized<T>& a, const Vectorized<T>& lse) {
  return vexp(at::vec::minimum(x * a - lse, Vectorized<T>(T(0))));
}

// x <- prob(x, a, lse) in place, element-wise.
template <typename T>
void probs(T* x, int64_t n, T a, T lse) {
  using V = Vectorized<T>;
  const V va(a), vl(lse);
  at::vec::map([&](V v) { return prob(v, va, vl); }, x, x, n);
}

// n rounded up to whole vectors of T (buffers read and written a vector at a time).
template <typename T>
constexpr int64_t whole_vectors(int64_t n) {
  constexpr int64_t w = Vectorized<T>::size();
  return (n + w - 1) / w * w;
}

// A signed integer key with the order of the floating-point values (-0 as +0; NaN of either sign
// at an end). The least key, INT_MIN, marks padded keys: real ones are clamped above it.
inline int32_t order_key(float f) {
  f += 0.0f;  // -0 + 0 = +0: equal scores must tie, as in torch.topk
  int32_t i;
  std::memcpy(&i, &f, sizeof i);
  return std::max(i >= 0 ? i : i ^ 0x7fffffff, std::numeric_limits<int32_t>::min() + 1);
}
inline int64_t order_key(double f) {
  f += 0.0;
  int64_t i;
  std::memcpy(&i, &f, sizeof i);
  return std::max(i >= 0 ? i : i ^ 0x7fffffffffffffff, std::numeric_limits<int64_t>::min() + 1);
}

// Top-k of one row, streamed block by block, by threshold selection: keys above the current
// k-th best join a candidate buffer, which is cut back to its k best when full (and at the
// end). The cut finds the k-th largest key by bisection on its bits, each step one vectorised
// count, so a row costs a few passes over its keys and no unpredictable branches; once the
// buffer holds good keys, most chunks of a long row are skipped by one vector comparison.
// Ties keep the lower index (candidates stay in index order).
template <typename T>
struct TopK {
  using S = std::conditional_t<std::is_same_v<T, float>, int32_t, int64_t>;
  using U = std::make_unsigned_t<S>;
  static constexpr S kPadded = std::numeric_limits<S>::min();
  S* key;          // cap candidates' keys, in index order (and room to pad to whole vectors)
  int32_t* index;  // and their key indices
  int64_t k = 0, cap = 0, size = 0;
  S floor = kPadded;  // a candidate needs a key above it

  // Offer keys j0 .. j0+n-1 with scores x; `real` (or null) marks the keys that take part.
  // `scratch` holds n keys.
  void offer(const T* x, int64_t n, int64_t j0, const bool* real, S* scratch) {
    for (int64_t j = 0; j < n; ++j) scratch[j] = order_key(x[j]);
    if (real)
      for (int64_t j = 0; j < n; ++j) scratch[j] = real[j] ? scratch[j] : kPadded;
    constexpr int64_t W = 16;
    for (int64_t c = 0; c < n; c += W) {
      const int64_t e = std::min(n, c + W);
      S top = kPadded, low = std::numeric_limits<S>::max();
      for (int64_t j = c; j < e; ++j) {
        top = std::max(top, scratch[j]);
        low = std::min(low, scratch[j]);
      }
      if (top <= floor) continue;  // the common case once the buffer holds good keys
      if (size + W > cap) cut();   // full: keep the k best, raising the floor
      if (low > floor) {           // every key of the chunk is a candidate (a row's first keys)
        std::copy(scratch + c, scratch + e, key + size);
        for (int64_t j = c; j < e; ++j) index[size + j - c] = static_cast<int32_t>(j0 + j);
        size += e - c;
        continue;
      }
      S* const kp = key;
      int32_t* const ip = index;
      const S lo = floor;
      int64_t sz = size;
      for (int64_t j = c; j < e; ++j) {
        kp[sz] = scratch[j];
        ip[sz] = static_cast<int32_t>(j0 + j);
        sz += scratch[j] > lo;
      }
      size = sz;
    }
  }

  // How many of the n keys are >= t; kp holds padded keys up to a whole number of vectors.
  static int64_t count_at_least(const S* kp, int64_t n, S t) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (sizeof(S) == 4) {  // masks counted, no vector summed: 2-4% off the forward at N = 197, 1,025
      const __m512i vt = _mm512_set1_epi32(t);
      int64_t count = 0;
      for (int64_t i = 0; i < n; i += 16)
        count += __builtin_popcount(_mm512_cmpge_epi32_mask(_mm512_loadu_si512(kp + i), vt));
      return count;
    }
#endif
    using V = Vectorized<S>;
    const V vt(t);
    V acc(S(0));
    for (int64_t i = 0; i < n; i += V::size()) acc = acc - (V::loadu(kp + i) >= vt);  // true lanes are -1
    S lanes[V::size()];
    acc.store(lanes);
    return std::accumulate(lanes, lanes + V::size(), int64_t(0));
  }

  // Keep the k best candidates, in index order; `floor` becomes the least kept key.
  void cut() {
    if (size <= k) return;
    S* const kp = key;
    int32_t* const ip = index;
    const int64_t n = size;
    std::fill(kp + n, kp + whole_vectors<S>(n), kPadded);
    // The k-th largest key, bit by bit from the top in the unsigned order (u = key ^ min).
    U tau = 0;
    int64_t at_least = n;  // keys >= tau's key
    for (int bit = 8 * sizeof(U) - 1; bit >= 0; --bit) {
      const U t = tau | (U(1) << bit);
      const int64_t c = count_at_least(kp, n, static_cast<S>(t ^ U(kPadded)));
      if (c >= k) {
        tau = t;
        at_least = c;
        if (c == k) break;  // exactly k keys >= t: they are the k best
      }
    }
    const S th = static_cast<S>(tau ^ U(kPadded));
    int64_t kept = 0;
    S least = std::numeric_limits<S>::max();
    if (at_least == k) {  // the common case: exactly the keys >= th (branch-free, as which survive is data-dependent)
      int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (sizeof(S) == 4) {  // 16 at a time: the survivors of each vector packed by one compress
        const __m512i vth = _mm512_set1_epi32(th);
        __m512i low = _mm512_set1_epi32(std::numeric_limits<int32_t>::max());
        for (; i + 16 <= n; i += 16) {  // kept <= i: the stores reach no key not yet loaded
          const __m512i u = _mm512_loadu_si512(kp + i), ix = _mm512_loadu_si512(ip + i);
          const __mmask16 keep = _mm512_cmpge_epi32_mask(u, vth);
          _mm512_storeu_si512(kp + kept, _mm512_maskz_compress_epi32(keep, u));
          _mm512_storeu_si512(ip + kept, _mm512_maskz_compress_epi32(keep, ix));
          low = _mm512_mask_min_epi32(low, keep, low, u);
          kept += __builtin_popcount(keep);
        }
        least = _mm512_reduce_min_epi32(low);
      }
#endif
      for (; i < n; ++i) {
        const S u = kp[i];
        const bool keep = u >= th;
        kp[kept] = u;
        ip[kept] = ip[i];
        kept += keep;
        least = std::min(least, keep ? u : least);
      }
    } else {  // keys equal to th beyond the k-th: the first ones (lower indices) stay
      int64_t ties = k - (at_least - std::count(kp, kp + n, th));
      for (int64_t i = 0; i < n; ++i) {
        const S u = kp[i];
        const bool tie = u == th, keep = u > th || (tie && ties > 0);
        ties -= tie & keep;
        kp[kept] = u;
        ip[kept] = ip[i];
        kept += keep;
        least = std::min(least, keep ? u : least);
      }
    }
    size = kept;
    floor = least;
  }

  // The kept key indices, best first (like torch.topk(sorted=True)), into out. (key, index) are
  // packed into one unsigned integer each (float keys), all distinct, so each one's place is the
  // number of others above it: k^2 comparisons, vectorised and branch-free, beat a sort's
  // mispredicted branches at the k of vision and LRA models (measured at k = 49: an insertion
  // sort was a fifth of the top-k phase); a sort above 256.
  void sorted_indices(int64_t* out) {
    cut();
    if constexpr (sizeof(S) == 4) {
      std::vector<uint64_t> packed(size);  // higher = better: key, then the lower index
      for (int64_t i = 0; i < size; ++i)
        packed[i] = (uint64_t(uint32_t(key[i]) ^ 0x80000000u) << 32) | (0xffffffffu - uint32_t(index[i]));
      if (size <= 256) {
        for (int64_t i = 0; i < size; ++i) {
          int64_t place = 0;
          for (int64_t j = 0; j < size; ++j) place += packed[j] > packed[i];
          out[place] = 0xffffffffu - uint32_t(packed[i]);
        }
      } else {
        std::sort(packed.begin(), packed.end(), std::greater<>());
        for (int64_t i = 0; i < size; ++i) out[i] = 0xffffffffu - uint32_t(packed[i]);
      }
    } else {
      std::vector<std::pair<S, int32_t>> v(size);
      for (int64_t i = 0; i < size; ++i) v[i] = {key[i], -index[i]};
      std::sort(v.begin(), v.end(), std::greater<>());
      for (int64_t i = 0; i < size; ++i) out[i] = -v[i].second;
    }
  }
};

// Counting sort of one head's (query, route) pairs by expert: members[start[e] .. start[e + 1])
// holds t * s + j for each query t routed to expert e as its j-th route, in query order.
// Padded queries take no part.
void group_by_expert(const int64_t* routes, const bool* qm, int64_t Nq, int64_t s, int64_t m, int64_t* start,
                     int64_t* members) {
  std::fill(start, start + m + 1, 0);
  for (int64_t t = 0; t < Nq; ++t)
    if (!qm || qm[t])
      for (int64_t j = 0; j < s; ++j) ++start[routes[t * s + j] + 1];
  for (int64_t e = 0; e < m; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start, start + m);
  for (int64_t t = 0; t < Nq; ++t)
    if (!qm || qm[t])
      for (int64_t j = 0; j < s; ++j) members[fill[routes[t * s + j]]++] = t * s + j;
}

// out = a + log(sum), element-wise (the tail in one partial vector: experts hold few queries).
template <typename T>
void log_add(const T* sum, const T* a, T* out, int64_t n) {
  using V = Vectorized<T>;
  for (int64_t i = 0; i < n; i += V::size()) {
    const int64_t c = std::min<int64_t>(V::size(), n - i);
    (V::loadu(a + i, c) + V::loadu(sum + i, c).log()).store(out + i, c);
  }
}

// log(1 + e) for e in [0, 1] (floats): 2 atanh(z) with z = e / (2 + e) <= 1/3, the odd series
// to z^13 (relative error at most 1.5e-8 in exact arithmetic, under float32's rounding); exact to
// rounding for small e, like log1p. One
// division and a polynomial: Sleef's log1p was 3% of the forward at N = 197 (perf, AVX-512).
inline Vectorized<float> log1p_unit(const Vectorized<float>& e) {
  using V = Vectorized<float>;
  const V z = e / (V(2.f) + e), z2 = z * z;
  V p(1.f / 13);
  for (const float c : {1.f / 11, 1.f / 9, 1.f / 7, 1.f / 5, 1.f / 3, 1.f}) p = at::vec::fmadd(p, z2, V(c));
  return V(2.f) * z * p;
}

// Two partial softmaxes with log-sum-exps a (shared) and c (routed): w = sigmoid(c - a), the
// routed one's share, and a <- logaddexp(a, c), the joint log-sum-exp; element-wise. One
// exponential, e = exp(-|a - c|): w = e / (1 + e) where a >= c, else 1 / (1 + e).
template <typename T>
void sigmoid_logaddexp(const T* c, T* a, T* w, int64_t n) {
  using V = Vectorized<T>;
  const V one(T(1));
  for (int64_t i = 0; i < n; i += V::size()) {
    const int64_t m = std::min<int64_t>(V::size(), n - i);
    const V va = V::loadu(a + i, m), vc = V::loadu(c + i, m), d = va - vc;
    const V e = vexp(-d.abs());
    (V::blendv(one, e, d >= V(T(0))) / (one + e)).store(w + i, m);
    if constexpr (std::is_same_v<T, float>) {
      (at::vec::maximum(va, vc) + log1p_unit(e)).store(a + i, m);
    } else {
      (at::vec::maximum(va, vc) + e.log1p()).store(a + i, m);
    }
  }
}

// Products too small for a BLAS call to pay for itself (an expert of a few queries at vision
// sizes): C (M x N) = sum_l A(i, l) * row_l(B) (+ C when `add`), where A(i, l) = a(i)[l * as]
// and b(l) points to row l of B, so that either operand is read in place, transposed or
// gathered by index, without copies. Register tiles of R rows by NV vectors, A broadcast.
template <typename T, int R, int NV, bool Full, typename AF, typename BF>
void small_tile(int64_t i0, int64_t j0, int64_t K, int64_t last, const AF& a, int64_t as, const BF& b, T* C,
                int64_t ldc, bool add) {
  using V = Vectorized<T>;
  // U partial sums over l per output vector, so that a narrow tile (a leftover row) has enough
  // independent multiply-add chains in flight: with one chain each step waits the FMA's latency.
  constexpr int U = Full ? std::max(1, 8 / (R * NV)) : 1;
  V c[U][R][NV];
  const T* ap[R];
  for (int r = 0; r < R; ++r) ap[r] = a(i0 + r);
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) c[u][r][v] = V(T(0));
  int64_t l = 0;
  for (; l + U <= K; l += U)
    for (int u = 0; u < U; ++u) {
      const T* row = b(l + u) + j0;
      V bv[NV];
      for (int v = 0; v < NV; ++v)
        bv[v] = !Full && v == NV - 1 ? V::loadu(row + v * V::size(), last) : V::loadu(row + v * V::size());
      for (int r = 0; r < R; ++r) {
        const V av(ap[r][(l + u) * as]);
        for (int v = 0; v < NV; ++v) c[u][r][v] = at::vec::fmadd(av, bv[v], c[u][r][v]);
      }
    }
  for (; l < K; ++l) {  // the last K % U steps (U > 1 only where the last vector is whole)
    const T* row = b(l) + j0;
    for (int r = 0; r < R; ++r) {
      const V av(ap[r][l * as]);
      for (int v = 0; v < NV; ++v) c[0][r][v] = at::vec::fmadd(av, V::loadu(row + v * V::size()), c[0][r][v]);
    }
  }
  for (int u = 1; u < U; ++u)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) c[0][r][v] = c[0][r][v] + c[u][r][v];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) {
      T* p = C + (i0 + r) * ldc + j0 + v * V::size();
      const int64_t n = v == NV - 1 ? last : V::size();
      const V out = add ? c[0][r][v] + V::loadu(p, n) : c[0][r][v];
      out.store(p, n);
    }
}

// small_tile with `last` fixed where it can be: a tile whose last vector is whole (every product
// of D = 64, and the lane-padded query columns) has no partial load in its loop, which let the
// compiler keep the accumulators in registers (measured 4-5% off the forward at N = 197, 1,025).
template <typename T, int R, int NV, typename AF, typename BF>
void small_tile_any(int64_t i0, int64_t j0, int64_t K, int64_t last, const AF& a, int64_t as, const BF& b, T* C,
                    int64_t ldc, bool add) {
  if (last == Vectorized<T>::size())
    small_tile<T, R, NV, true>(i0, j0, K, last, a, as, b, C, ldc, add);
  else
    small_tile<T, R, NV, false>(i0, j0, K, last, a, as, b, C, ldc, add);
}

template <typename T, int R, typename AF, typename BF>
void small_rows(int64_t nv, int64_t i0, int64_t j0, int64_t K, int64_t last, const AF& a, int64_t as, const BF& b,
                T* C, int64_t ldc, bool add) {
  switch (nv) {
    case 1: return small_tile_any<T, R, 1>(i0, j0, K, last, a, as, b, C, ldc, add);
    case 2: return small_tile_any<T, R, 2>(i0, j0, K, last, a, as, b, C, ldc, add);
    case 3: return small_tile_any<T, R, 3>(i0, j0, K, last, a, as, b, C, ldc, add);
    default: return small_tile_any<T, R, 4>(i0, j0, K, last, a, as, b, C, ldc, add);
  }
}

template <typename T, typename AF, typename BF>
void small_gemm(int64_t M, int64_t N, int64_t K, const AF& a, int64_t as, const BF& b, T* C, int64_t ldc,
                bool add = false) {
  constexpr int64_t W = Vectorized<T>::size();
  for (int64_t j0 = 0; j0 < N; j0 += 4 * W) {
    const int64_t nv = std::min<int64_t>(4, (N - j0 + W - 1) / W), last = std::min(W, N - j0 - (nv - 1) * W);
    int64_t i0 = 0;
    if (nv == 1)  // one vector a row: 8 rows keep 8 independent multiply-add chains in flight
      for (; i0 + 8 <= M; i0 += 8) small_tile_any<T, 8, 1>(i0, j0, K, last, a, as, b, C, ldc, add);
    for (; i0 + 4 <= M; i0 += 4) small_rows<T, 4>(nv, i0, j0, K, last, a, as, b, C, ldc, add);
    if (M - i0 >= 2) {
      small_rows<T, 2>(nv, i0, j0, K, last, a, as, b, C, ldc, add);
      i0 += 2;
    }
    if (M - i0 == 1) small_rows<T, 1>(nv, i0, j0, K, last, a, as, b, C, ldc, add);
  }
}

// Asks for a row gathered by index (an expert's keys, values, queries) ahead of its use: the
// hardware prefetcher cannot guess such rows (4-5% off the forward at N = 1,025 on the EPYC VM, 2%
// on the Xeon; in the backward, whose gathers are copies, it measured no gain). Only for heads
// whose keys take more than kPrefetchAbove bytes: at N = 197 (50 KB, the rows mostly still in L1
// from phase A) the forward ran 2-3% faster without.
constexpr int64_t kPrefetchAbove = int64_t(1) << 17;
template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  for (int64_t c = 0; c < D; c += 64 / int64_t(sizeof(T))) __builtin_prefetch(row + c);
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
  for (int s = 0, b = 8; b >= 1; ++s, b /= 2) {
    const __m512i lo = _mm512_loadu_si512(idx[2 * s].data()), hi = _mm512_loadu_si512(idx[2 * s + 1].data());
    for (int i = 0; i < 16; ++i)
      if (!(i & b)) {
        const __m512 a = r[i], c = r[i + b];
        r[i] = _mm512_permutex2var_ps(a, lo, c);
        r[i + b] = _mm512_permutex2var_ps(a, hi, c);
      }
  }
}
#elif defined(CPU_CAPABILITY_AVX2)
// 8 vectors of 8 floats transposed in registers, r[i][j] <- r[j][i]: pairs of rows interleaved,
// then pairs of pairs (columns c and c + 4 of four rows), then the 128-bit halves exchanged.
inline void transpose_block(Vectorized<float> r[8]) {
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

// Qt (D x ld) = scale * the rows row(0 .. nb) as its columns, columns nb .. ld zero (a small
// expert's queries as lanes; an operand of gemm transposed). With AVX-512 or AVX2 by square blocks
// transposed in registers (a partial block's missing rows loaded as zeros, its missing columns not
// stored): the element-wise stores were a fifth of the routed phase at N = 197.
template <typename T, typename RF>
void rows_as_columns(int64_t nb, int64_t D, int64_t ld, T scale, const RF& row, T* Qt) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    using V = Vectorized<float>;
    constexpr int W = V::size();
    const V vs(scale);
    for (int64_t i0 = 0; i0 < ld; i0 += W) {
      const T* rp[W];
      for (int i = 0; i < W; ++i) rp[i] = i0 + i < nb ? row(i0 + i) : nullptr;
      for (int64_t d0 = 0; d0 < D; d0 += W) {
        const int64_t n = std::min<int64_t>(W, D - d0);
        V r[W];
        for (int i = 0; i < W; ++i)
          r[i] = rp[i] ? (n == W ? V::loadu(rp[i] + d0) : V::loadu(rp[i] + d0, n)) * vs : V(0.f);
        transpose_block(r);
        for (int c = 0; c < n; ++c) r[c].store(Qt + (d0 + c) * ld + i0);
      }
    }
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) std::fill(Qt + d * ld + nb, Qt + (d + 1) * ld, T(0));
  for (int64_t i = 0; i < nb; ++i) {
    const T* q = row(i);
    for (int64_t d = 0; d < D; ++d) Qt[d * ld + i] = scale * q[d];
  }
}

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
      const int64_t out = whole_vectors<float>(rows);
      buf.resize(cols * out);
      rows_as_columns(rows, cols, out, 1.f, [&](int64_t i) { return X + i * ld; }, buf.data());
      ld = out;
      return static_cast<const float*>(buf.data());
    };
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

// Up to this many multiply-adds (queries x keys x D) an expert's products skip BLAS: in the
// forward up to 2^20 (2^17: 2-9% slower at N = 1,025-4,096; no limit: 1.5-1.8% slower at 16,384 and
// 65,536), in the backward up to 2^17 (2^19: 9% slower at N = 4,096).
constexpr int64_t kSmallForward = int64_t(1) << 20, kSmallBackward = int64_t(1) << 17;

// Where the rows of a (B, H, N, D) tensor lie: element (b, h, t, d) at b * sb + h * sh + t * st + d.
// The kernels read q, k, v, out and dout in any such layout (a timm block's q, k, v are views of
// one qkv buffer; the output is written as (B, N, H, D), ready for the projection), so the
// layers pass them without copies.
struct Rows {
  int64_t sb = 0, sh = 0, st = 0;
  explicit Rows(const at::Tensor& t) : sb(t.stride(0)), sh(t.stride(1)), st(t.stride(2)) {}
  int64_t head(int64_t b, int64_t h) const { return b * sb + h * sh; }
};

// Landmark pooling (step 1) as bins: bin i holds tokens[offsets[i] .. offsets[i + 1]), each bin
// a mean of its tokens' rows (the adaptive-pooling bins, built once per shape in pooling.py).
struct Bins {
  const int64_t* offsets = nullptr;  // m + 1
  const int64_t* tokens = nullptr;
  explicit operator bool() const { return offsets != nullptr; }
};

// Lx[i] = mean of Qx[t] over the tokens t of bin i (summed in token order, then divided, as
// adaptive_avg_pool does).
template <typename T>
void pool_head(const T* Qx, int64_t st, int64_t m, int64_t D, Bins bins, T* Lx) {
  for (int64_t i = 0; i < m; ++i) {
    T* l = Lx + i * D;
    std::fill(l, l + D, T(0));
    for (int64_t p = bins.offsets[i]; p < bins.offsets[i + 1]; ++p) {
      const T* row = Qx + bins.tokens[p] * st;
      for (int64_t d = 0; d < D; ++d) l[d] += row[d];
    }
    const T n = static_cast<T>(bins.offsets[i + 1] - bins.offsets[i]);
    for (int64_t d = 0; d < D; ++d) l[d] /= n;
  }
}

// The transpose of pool_head: dQx[t] += dLx[i] / |bin i| for the tokens t of bin i.
template <typename T>
void unpool_head(const T* dLx, int64_t m, int64_t D, Bins bins, T* dQx) {
  for (int64_t i = 0; i < m; ++i) {
    const T w = T(1) / static_cast<T>(bins.offsets[i + 1] - bins.offsets[i]);
    for (int64_t p = bins.offsets[i]; p < bins.offsets[i + 1]; ++p) {
      T* row = dQx + bins.tokens[p] * D;
      for (int64_t d = 0; d < D; ++d) row[d] += w * dLx[i * D + d];
    }
  }
}

constexpr int64_t kKeyBlock = 512, kQueryBlock = 256;  // measured best of 256-1024 / 64-512 at N = 16,384
// A head whose q, k and v fit in this many bytes (about L2) runs all its phases in one task, so
// small heads (vision sizes) pay no per-phase scheduling and meet their data in cache; larger
// heads split each phase across the threads.
constexpr int64_t kSmallHead = int64_t(1) << 20;

// The forward of one call: the phases of the header as functions of (head, block), scheduled by
// forward_impl either head by head (small heads) or phase by phase (large ones).
template <typename T>
struct Forward {
  using Key = typename TopK<T>::S;
  int64_t H, Nq, D, Hkv, Nk, m, G, topk, s;
  T scale, lscale;
  const T *Q, *K, *Vv;
  Rows qr, kr, vr, outr;  // the layouts of q, k, v, out
  T* L;  // the landmarks: given, or pooled here from Q by `bins`
  Bins bins;
  const bool *key_mask, *query_mask;
  T *O, *VS, *LA, *LT, *LSE, *RO, *RL;
  int64_t *E, *R, *start, *members;
  std::vector<int64_t> n_real;

  // One thread's buffers, sized for phase A on up to `rows` landmark rows.
  struct Scratch {
    std::vector<T> S, mx, sum, Gt, Ke, Ve, Qb, Sb, Ob, lse, a, w;
    std::vector<Key> keys, block_keys;
    std::vector<int32_t> index;
    std::vector<int64_t> order;
    Scratch(const Forward& f, int64_t rows)
        : S(rows * kKeyBlock), mx(rows), sum(rows), Gt(kQueryBlock * f.m), Ke(f.topk * f.D), Ve(f.topk * f.D),
          Qb(kQueryBlock * f.D), Sb(kQueryBlock * std::max(f.topk, f.m)), Ob(kQueryBlock * f.D), lse(kQueryBlock),
          a(kQueryBlock), w(kQueryBlock), keys(rows * (f.topk + kKeyBlock + 2 * Vectorized<Key>::size())),
          block_keys(kKeyBlock), index(rows * (f.topk + kKeyBlock + 2 * Vectorized<Key>::size())), order(f.m) {}
  };

  // Head x's rows: element (t, d) of q at qx(x)[t * qr.st + d], and so on.
  const T* qx(int64_t x) const { return Q + qr.head(x / H, x % H); }
  const T* kx(int64_t x) const { return K + kr.head(x / H, (x % H) / G); }
  const T* vx(int64_t x) const { return Vv + vr.head(x / H, (x % H) / G); }
  T* ox(int64_t x) const { return O + outr.head(x / H, x % H); }

  // A: shared-expert values and the experts' keys of landmark rows r0 .. r0+nr of head x.
  void experts(int64_t x, int64_t r0, int64_t nr, Scratch& sc) const {
    const T ninf = -std::numeric_limits<T>::infinity();
    const int64_t kk = std::min(topk, n_real[x / H]);
    const T* Lx = L + (x * m + r0) * D;
    const T* Kx = kx(x);
    const T* Vx = vx(x);
    const bool* km = key_mask ? key_mask + (x / H) * Nk : nullptr;
    T* acc = VS + (x * m + r0) * D;
    std::fill(acc, acc + nr * D, T(0));
    std::fill(sc.mx.begin(), sc.mx.begin() + nr, ninf);
    std::fill(sc.sum.begin(), sc.sum.begin() + nr, T(0));
    const int64_t cap = topk + kKeyBlock, stride = whole_vectors<Key>(cap) + Vectorized<Key>::size();
    std::vector<TopK<T>> best(nr);
    for (int64_t r = 0; r < nr; ++r) best[r] = {sc.keys.data() + r * stride, sc.index.data() + r * stride, kk, cap};
    T* S = sc.S.data();
    for (int64_t j0 = 0; j0 < Nk; j0 += kKeyBlock) {
      const int64_t nb = std::min(kKeyBlock, Nk - j0);
      gemm<T>(false, true, nr, nb, D, Lx, D, Kx + j0 * kr.st, kr.st, false, S, nb);
      for (int64_t r = 0; r < nr; ++r) {
        T* row = S + r * nb;
        best[r].offer(row, nb, j0, km ? km + j0 : nullptr, sc.block_keys.data());
        if (km)
          for (int64_t j = 0; j < nb; ++j)
            if (!km[j0 + j]) row[j] = ninf;
        const T nm = std::max(sc.mx[r], row_max(row, nb));  // of the affinities, before the scale
        if (nm == ninf) {  // every key so far padded
          std::fill(row, row + nb, T(0));
          continue;
        }
        const T alpha = sc.mx[r] == ninf ? T(0) : std::exp(scale * (sc.mx[r] - nm));
        sc.sum[r] = sc.sum[r] * alpha + exp_sum(row, nb, scale, nm);
        if (alpha != T(1)) scale_row(acc + r * D, D, alpha);
        sc.mx[r] = nm;
      }
      gemm<T>(false, false, nr, D, nb, S, nb, Vx + j0 * vr.st, vr.st, true, acc, D);
    }
    for (int64_t r = 0; r < nr; ++r) {
      scale_row(acc + r * D, D, T(1) / sc.sum[r]);
      LA[x * m + r0 + r] = scale * sc.mx[r] + std::log(sc.sum[r]);
      int64_t* e = E + (x * m + r0 + r) * topk;
      best[r].sorted_indices(e);
      for (int64_t i = kk, j = 0; i < topk; ++i, ++j) {  // a short sequence: padded keys, in order
        while (km[j]) ++j;
        e[i] = j;
      }
    }
  }

  // B: gate, routes and the shared branch of queries t0 .. t0+nq of head x. The gates are
  // computed transposed, G^T = L Q^T (m x nq: MKL ran this shape 1.2-1.7x faster than Q L^T at
  // m = 49), so that the argmax and the softmax over the m landmarks run with the queries as lanes.
  void gate(int64_t x, int64_t t0, int64_t nq, Scratch& sc) const {
    using V = Vectorized<T>;
    const T ninf = -std::numeric_limits<T>::infinity();
    const bool* qm = query_mask ? query_mask + (x / H) * Nq : nullptr;
    const int64_t ld = whole_vectors<T>(nq);
    T* Gt = sc.Gt.data();
    gemm<T>(false, true, m, nq, D, L + x * m * D, D, qx(x) + t0 * qr.st, qr.st, false, Gt, ld);
    for (int64_t e = 0; e < m; ++e) std::fill(Gt + e * ld + nq, Gt + (e + 1) * ld, T(0));  // whole vectors
    if (s > 1)  // the s largest gates of each query, ties to the lower landmark
      for (int64_t i = 0; i < nq; ++i) {
        int64_t* order = sc.order.data();
        for (int64_t e = 0; e < m; ++e) order[e] = e;
        const T* col = Gt + i;
        std::partial_sort(order, order + s, order + m, [col, ld](int64_t a, int64_t c) {
          return col[a * ld] > col[c * ld] || (col[a * ld] == col[c * ld] && a < c);
        });
        std::copy(order, order + s, R + (x * Nq + t0 + i) * s);
      }
    const V vls(lscale), vninf(ninf);
    for (int64_t i0 = 0; i0 < ld; i0 += V::size()) {
      // The first largest gate of each query (a NaN among them routes to 0) and the largest gate.
      V gmax = vninf, best = vninf, arg(T(0));
      for (int64_t e = 0; e < m; ++e) {
        const V g = V::loadu(Gt + e * ld + i0);
        gmax = at::vec::maximum(gmax, g);
        const V better = g > best;
        best = V::blendv(best, g, better);
        arg = V::blendv(arg, V(T(e)), better);
      }
      arg = V::blendv(arg, V(T(0)), gmax != gmax);
      const V lmax = gmax * vls;  // the largest logit
      V sum(T(0));
      for (int64_t e = 0; e < m; ++e) {  // the difference scaled, never above 0: see exp_sum
        const V p = vexp((V::loadu(Gt + e * ld + i0) - gmax) * vls);
        p.store(Gt + e * ld + i0);
        sum = sum + p;
      }
      const V inv = V(T(1)) / sum;
      for (int64_t e = 0; e < m; ++e) (V::loadu(Gt + e * ld + i0) * inv).store(Gt + e * ld + i0);
      lmax.store(sc.a.data() + i0);
      sum.store(sc.w.data() + i0);
      if (s == 1) {
        T args[V::size()];
        arg.store(args);
        for (int64_t i = i0; i < std::min(nq, i0 + V::size()); ++i) R[x * Nq + t0 + i] = int64_t(args[i - i0]);
      }
    }
    if (qm)
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t t = t0 + i;
        if (qm[t]) continue;
        // A padded query: no routes of its own, zero output.
        for (int64_t j = 0; j < s; ++j) R[(x * Nq + t) * s + j] = j;
        for (int64_t e = 0; e < m; ++e) Gt[e * ld + i] = T(0);
        sc.a[i] = ninf;
        sc.w[i] = T(1);
        LT[x * Nq + t] = T(0);
      }
    log_add(sc.w.data(), sc.a.data(), LSE + x * Nq + t0, nq);  // lse = max + log(sum)
    gemm<T>(true, false, nq, D, m, Gt, ld, VS + x * m * D, D, false, ox(x) + t0 * outr.st, outr.st);
  }

  // C: the routed expert e of head x attends its queries; merged into out (s = 1) or kept.
  void routed(int64_t x, int64_t e, Scratch& sc) const {
    const int64_t* st = start + x * (m + 1);
    const int64_t n_e = st[e + 1] - st[e];
    if (n_e == 0) return;
    const int64_t kk = std::min(topk, n_real[x / H]);
    const int64_t* keys = E + (x * m + e) * topk;
    const T* Kx = kx(x);
    const T* Vx = vx(x);
    T *Ke = sc.Ke.data(), *Ve = sc.Ve.data(), *Qb = sc.Qb.data(), *Sb = sc.Sb.data(), *Ob = sc.Ob.data();
    const int64_t* mem = members + x * Nq * s + st[e];
    if (n_e <= kQueryBlock && n_e * kk * D <= kSmallForward) {  // a small expert: in registers, no gathers
      small_expert(x, mem, n_e, kk, keys, sc);
      merge_block(x, mem, n_e, sc);
      return;
    }
    for (int64_t i = 0; i < kk; ++i) {
      std::copy(Kx + keys[i] * kr.st, Kx + keys[i] * kr.st + D, Ke + i * D);
      std::copy(Vx + keys[i] * vr.st, Vx + keys[i] * vr.st + D, Ve + i * D);
    }
    for (int64_t i0 = 0; i0 < n_e; i0 += kQueryBlock) {
      const int64_t nb = std::min(kQueryBlock, n_e - i0);
      for (int64_t i = 0; i < nb; ++i) {
        const T* src = qx(x) + (mem[i0 + i] / s) * qr.st;
        std::copy(src, src + D, Qb + i * D);
      }
      gemm<T>(false, true, nb, kk, D, Qb, D, Ke, D, false, Sb, kk);
      for (int64_t i = 0; i < nb; ++i) {
        T* row = Sb + i * kk;
        const auto [sm, rm] = exp_row(row, kk, scale);
        scale_row(row, kk, T(1) / sm);
        sc.w[i] = sm;
        sc.a[i] = rm;
      }
      log_add(sc.w.data(), sc.a.data(), sc.lse.data(), nb);
      gemm<T>(false, false, nb, D, kk, Sb, kk, Ve, D, false, Ob, D);
      merge_block(x, mem + i0, nb, sc);
    }
  }

  // The routed softmax of a small expert's nb queries (slots mem) over its kk keys, into sc.Ob and
  // sc.lse: S^T = K_e Q^T (keys by index, queries packed as columns), a softmax down each column,
  // out = P V_e (values by index).
  void small_expert(int64_t x, const int64_t* mem, int64_t nb, int64_t kk, const int64_t* keys, Scratch& sc) const {
    using V = Vectorized<T>;
    const T* Kx = kx(x);
    const T* Vx = vx(x);
    T *Qt = sc.Qb.data(), *St = sc.Sb.data();
    const int64_t ld = whole_vectors<T>(nb);  // no masked loads
    if (Nk * D * int64_t(sizeof(T)) > kPrefetchAbove) {
      for (int64_t i = 0; i < nb; ++i) prefetch_row(qx(x) + (mem[i] / s) * qr.st, D);
      for (int64_t j = 0; j < kk; ++j) {
        prefetch_row(Kx + keys[j] * kr.st, D);
        prefetch_row(Vx + keys[j] * vr.st, D);
      }
    }
    rows_as_columns<T>(nb, D, ld, scale, [&](int64_t i) { return qx(x) + (mem[i] / s) * qr.st; }, Qt);
    small_gemm<T>(
        kk, ld, D, [&](int64_t j) { return Kx + keys[j] * kr.st; }, 1, [&](int64_t d) { return Qt + d * ld; }, St,
        ld);
    for (int64_t i0 = 0; i0 < ld; i0 += V::size()) {  // the queries are the lanes
      V mx(-std::numeric_limits<T>::infinity()), sum(T(0));
      for (int64_t j = 0; j < kk; ++j) mx = at::vec::maximum(mx, V::loadu(St + j * ld + i0));
      for (int64_t j = 0; j < kk; ++j) {
        const V p = vexp(V::loadu(St + j * ld + i0) - mx);
        p.store(St + j * ld + i0);
        sum = sum + p;
      }
      const V inv = V(T(1)) / sum;
      for (int64_t j = 0; j < kk; ++j) (V::loadu(St + j * ld + i0) * inv).store(St + j * ld + i0);
      (mx + sum.log()).store(sc.lse.data() + i0);
    }
    small_gemm<T>(
        nb, D, kk, [&](int64_t i) { return St + i; }, ld, [&](int64_t j) { return Vx + keys[j] * vr.st; }, sc.Ob.data(),
        D);
  }

  // Merges a block of nb routed results (sc.Ob, sc.lse; slots mem) into out (s = 1) or keeps them.
  void merge_block(int64_t x, const int64_t* mem, int64_t nb, Scratch& sc) const {
    const T* Ob = sc.Ob.data();
    if (s == 1) {  // out = lerp(out_shared, out_routed, sigmoid(lse_r - lse_shared)), lse_t = logaddexp
      for (int64_t i = 0; i < nb; ++i) sc.a[i] = LSE[x * Nq + mem[i]];
      sigmoid_logaddexp(sc.lse.data(), sc.a.data(), sc.w.data(), nb);  // w, and a <- lse_t
      for (int64_t i = 0; i < nb; ++i) {
        const int64_t t = mem[i];
        LT[x * Nq + t] = sc.a[i];
        T* o = ox(x) + t * outr.st;
        const T* r = Ob + i * D;
        const T wi = sc.w[i];
        for (int64_t d = 0; d < D; ++d) o[d] += wi * (r[d] - o[d]);
      }
    } else {
      for (int64_t i = 0; i < nb; ++i) {
        const int64_t slot = mem[i];
        std::copy(Ob + i * D, Ob + (i + 1) * D, RO + (x * Nq * s + slot) * D);
        RL[x * Nq * s + slot] = sc.lse[i];
      }
    }
  }

  // s > 1: out and lse_t of queries xt0 .. xt1 (flat over heads) from softmax([lse_shared, lse_r1 .. lse_rs]).
  void merge(int64_t xt0, int64_t xt1) const {
    std::vector<T> w(s + 1);
    for (int64_t xt = xt0; xt < xt1; ++xt) {
      if (query_mask && !query_mask[(xt / (H * Nq)) * Nq + xt % Nq]) continue;
      w[0] = LSE[xt];
      std::copy(RL + xt * s, RL + (xt + 1) * s, w.begin() + 1);
      const T wm = *std::max_element(w.begin(), w.end());
      T ws = 0;
      for (auto& a : w) ws += (a = std::exp(a - wm));
      LT[xt] = wm + std::log(ws);
      T* o = ox(xt / Nq) + (xt % Nq) * outr.st;
      for (int64_t d = 0; d < D; ++d) {
        T a = w[0] * o[d];
        for (int64_t j = 0; j < s; ++j) a += w[j + 1] * RO[(xt * s + j) * D + d];
        o[d] = a / ws;
      }
    }
  }

  void group(int64_t x) const {
    group_by_expert(R + x * Nq * s, query_mask ? query_mask + (x / H) * Nq : nullptr, Nq, s, m, start + x * (m + 1),
                    members + x * Nq * s);
  }

  void pool(int64_t x) const {
    if (bins) pool_head(qx(x), qr.st, m, D, bins, L + x * m * D);
  }

  // Every phase of head x, in turn.
  void head(int64_t x, Scratch& sc) const {
    pool(x);
    experts(x, 0, m, sc);
    for (int64_t t0 = 0; t0 < Nq; t0 += kQueryBlock) gate(x, t0, std::min(kQueryBlock, Nq - t0), sc);
    group(x);
    for (int64_t e = 0; e < m; ++e) routed(x, e, sc);
    if (s > 1) merge(x * Nq, (x + 1) * Nq);
  }
};

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& lm, Bins bins,
                  const bool* key_mask, const bool* query_mask, int64_t topk, int64_t s, double scale_,
                  double landmark_scale_, at::Tensor& out, at::Tensor& experts, at::Tensor& routes,
                  at::Tensor& v_shared, at::Tensor& lse_a, at::Tensor& lse_t) {
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Nk = k.size(2), m = lm.size(2), X = B * H;
  const auto opts = q.options();
  at::Tensor lse_shared = at::empty({X, Nq}, opts);
  at::Tensor count_t = at::empty({X, m + 1}, opts.dtype(at::kLong));
  at::Tensor members_t = at::empty({X, Nq * s}, opts.dtype(at::kLong));
  at::Tensor routed_out, routed_lse;  // s > 1: each (query, route) result, merged after
  if (s > 1) {
    routed_out = at::empty({X, Nq * s, D}, opts);
    routed_lse = at::empty({X, Nq * s}, opts);
  }
  Forward<T> f{H, Nq, D, Hkv, Nk, m, H / Hkv, topk, s, static_cast<T>(scale_), static_cast<T>(landmark_scale_),
               q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), Rows(q), Rows(k), Rows(v), Rows(out),
               lm.data_ptr<T>(), bins, key_mask, query_mask,
               out.data_ptr<T>(), v_shared.data_ptr<T>(), lse_a.data_ptr<T>(), lse_t.data_ptr<T>(),
               lse_shared.data_ptr<T>(), s > 1 ? routed_out.data_ptr<T>() : nullptr,
               s > 1 ? routed_lse.data_ptr<T>() : nullptr, experts.data_ptr<int64_t>(), routes.data_ptr<int64_t>(),
               count_t.data_ptr<int64_t>(), members_t.data_ptr<int64_t>(), std::vector<int64_t>(B, Nk)};
  if (key_mask)
    for (int64_t b = 0; b < B; ++b) f.n_real[b] = std::count(key_mask + b * Nk, key_mask + (b + 1) * Nk, true);

  const int64_t threads = at::get_num_threads();
  if ((Nq + 2 * Nk) * D * int64_t(sizeof(T)) <= kSmallHead && X >= threads) {
    at::parallel_for(0, X, 1, [&](int64_t begin, int64_t end) {
      const SingleThreadedBlas blas;
      typename Forward<T>::Scratch sc(f, m);
      for (int64_t x = begin; x < end; ++x) f.head(x, sc);
    });
    return;
  }
  // Large heads: each phase split across the threads (landmark rows, query blocks, experts).
  if (bins) at::parallel_for(0, X, 1, [&](int64_t begin, int64_t end) {
      for (int64_t x = begin; x < end; ++x) f.pool(x);
    });
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>((threads + X - 1) / X, m / 16));
  const int64_t rows = (m + chunks - 1) / chunks;
  at::parallel_for(0, X * chunks, 1, [&](int64_t begin, int64_t end) {
    const SingleThreadedBlas blas;
    typename Forward<T>::Scratch sc(f, rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t x = item / chunks, r0 = (item % chunks) * rows, nr = std::min(rows, m - r0);
      if (nr > 0) f.experts(x, r0, nr, sc);
    }
  });
  // Items ordered (batch, query block, head): out is (B, N, H, D) in memory, so each thread writes
  // (and first touches) a range of out of its own instead of every thread every page.
  const int64_t qblocks = (Nq + kQueryBlock - 1) / kQueryBlock;
  at::parallel_for(0, X * qblocks, 1, [&](int64_t begin, int64_t end) {
    const SingleThreadedBlas blas;
    typename Forward<T>::Scratch sc(f, 1);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (qblocks * H), t0 = (item / H % qblocks) * kQueryBlock, x = b * H + item % H;
      f.gate(x, t0, std::min(kQueryBlock, Nq - t0), sc);
    }
  });
  at::parallel_for(0, X, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x) f.group(x);
  });
  at::parallel_for(0, X * m, 1, [&](int64_t begin, int64_t end) {
    const SingleThreadedBlas blas;
    typename Forward<T>::Scratch sc(f, 1);
    for (int64_t item = begin; item < end; ++item) f.routed(item / m, item % m, sc);
  });
  if (s > 1) at::parallel_for(0, X * Nq, 256, [&](int64_t begin, int64_t end) { f.merge(begin, end); });
}

// Backward of the joint softmax of step 6 and of V~ = softmax(s0 L K^T) V, per head x (one
// task per head: dq, dlandmarks and the head's dk, dv rows have one writer). p are the joint
// probabilities exp(logit - lse_t); with delta = <dout, out> per query, d logit = p (dp - delta).
// Order: the shared expert (dq written), the shared values (dk, dv written), the routed experts
// (added in; small ones in register tiles, as the forward's).
template <typename T>
void backward_impl(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& lm, const bool* key_mask, const bool* query_mask, const at::Tensor& experts,
                   const at::Tensor& routes, const at::Tensor& out, const at::Tensor& v_shared,
                   const at::Tensor& lse_a, const at::Tensor& lse_t, double scale_, double landmark_scale_,
                   Bins bins, const at::Tensor* dl_extra, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                   at::Tensor& dl) {
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Nk = k.size(2), m = lm.size(2), G = H / Hkv, X = B * H;
  const int64_t topk = experts.size(3), s = routes.size(3);
  const T scale = static_cast<T>(scale_), lscale = static_cast<T>(landmark_scale_);
  const T *dO = dout.data_ptr<T>(), *Q = q.data_ptr<T>(), *K = k.data_ptr<T>(), *Vv = v.data_ptr<T>();
  const T *L = lm.data_ptr<T>(), *O = out.data_ptr<T>(), *VS = v_shared.data_ptr<T>();
  const T *LA = lse_a.data_ptr<T>(), *LT = lse_t.data_ptr<T>();
  const int64_t *E = experts.data_ptr<int64_t>(), *R = routes.data_ptr<int64_t>();
  T *dQ = dq.data_ptr<T>(), *dK = dk.data_ptr<T>(), *dV = dv.data_ptr<T>(), *dL = dl.data_ptr<T>();
  const Rows qr(q), kr(k), vr(v), outr(out), dor(dout);  // dq, dk, dv are contiguous
  const int64_t qs = qr.st, ks = kr.st, vs = vr.st, os = outr.st, dos = dor.st;

  at::parallel_for(0, X, 1, [&](int64_t begin, int64_t end) {
    const SingleThreadedBlas blas;
    const int64_t nbuf = std::max({kQueryBlock, kKeyBlock, topk});
    std::vector<T> delta(Nq), dvs(m * D), rowdot(m), P(nbuf * std::max(m, topk)), dP(nbuf * std::max(m, topk));
    std::vector<T> Qb(kQueryBlock * D), dOb(kQueryBlock * D), dQb(kQueryBlock * D), Ke(topk * D), Ve(topk * D),
        dKe(topk * D), dVe(topk * D);
    std::vector<int64_t> start(m + 1), members(Nq * s);
    for (int64_t x = begin; x < end; ++x) {
      const int64_t b = x / H;
      const bool* qm = query_mask ? query_mask + b * Nq : nullptr;
      const bool* km = key_mask ? key_mask + b * Nk : nullptr;
      const int64_t kk = key_mask ? std::min<int64_t>(topk, std::count(km, km + Nk, true)) : topk;
      const int64_t h = x % H, hkv = h / G;
      const T *Qx = Q + qr.head(b, h), *dOx = dO + dor.head(b, h), *Ox = O + outr.head(b, h), *Lx = L + x * m * D;
      const T *VSx = VS + x * m * D, *Kx = K + kr.head(b, hkv), *Vx = Vv + vr.head(b, hkv), *LTx = LT + x * Nq;
      T *dQx = dQ + x * Nq * D, *dKx = dK + x * Nk * D, *dVx = dV + x * Nk * D, *dLx = dL + x * m * D;
      for (int64_t t = 0; t < Nq; ++t)
        delta[t] = (qm && !qm[t]) ? T(0) : at::vec::map2_reduce_all<T>(
            [](Vectorized<T> a, Vectorized<T> c) { return a * c; }, [](Vectorized<T> a, Vectorized<T> c) { return a + c; },
            dOx + t * dos, Ox + t * os, D);
      std::fill(dvs.begin(), dvs.end(), T(0));

      // Shared expert: logits ls * q.q~, values v~; transposed as in the forward's gate (m x nq,
      // the queries as lanes).
      for (int64_t t0 = 0; t0 < Nq; t0 += kQueryBlock) {
        using V = Vectorized<T>;
        const int64_t nq = std::min(kQueryBlock, Nq - t0), ld = whole_vectors<T>(nq);
        T *Pt = P.data(), *dPt = dP.data();
        gemm<T>(false, true, m, nq, D, Lx, D, Qx + t0 * qs, qs, false, Pt, ld);
        gemm<T>(false, true, m, nq, D, VSx, D, dOx + t0 * dos, dos, false, dPt, ld);
        const V vls(lscale);
        for (int64_t i0 = 0; i0 < nq; i0 += V::size()) {
          const int64_t c = std::min<int64_t>(V::size(), nq - i0);
          const V lse = V::loadu(LTx + t0 + i0, c), dl = V::loadu(delta.data() + t0 + i0, c);
          for (int64_t e = 0; e < m; ++e) {
            const V p = prob(V::loadu(Pt + e * ld + i0), vls, lse);
            p.store(Pt + e * ld + i0);
            (vls * p * (V::loadu(dPt + e * ld + i0) - dl)).store(dPt + e * ld + i0);
          }
        }
        if (qm)
          for (int64_t i = 0; i < nq; ++i)
            if (!qm[t0 + i])
              for (int64_t e = 0; e < m; ++e) Pt[e * ld + i] = dPt[e * ld + i] = T(0);
        gemm<T>(true, false, nq, D, m, dPt, ld, Lx, D, false, dQx + t0 * D, D);
        gemm<T>(false, false, m, D, nq, dPt, ld, Qx + t0 * qs, qs, true, dLx, D);
        gemm<T>(false, false, m, D, nq, Pt, ld, dOx + t0 * dos, dos, true, dvs.data(), D);
      }

      // Shared values v~ = softmax(s0 A) V, by key blocks: P_A recomputed from its log-sum-exp. It
      // covers every key, so it writes the head's dk and dv rows first (no zero-fill of them).
      for (int64_t i = 0; i < m; ++i)
        rowdot[i] = at::vec::map2_reduce_all<T>(
            [](Vectorized<T> a, Vectorized<T> c) { return a * c; }, [](Vectorized<T> a, Vectorized<T> c) { return a + c; },
            dvs.data() + i * D, VSx + i * D, D);
      for (int64_t j0 = 0; j0 < Nk; j0 += kKeyBlock) {
        const int64_t nb = std::min(kKeyBlock, Nk - j0);
        gemm<T>(false, true, m, nb, D, Lx, D, Kx + j0 * ks, ks, false, P.data(), nb);
        gemm<T>(false, true, m, nb, D, dvs.data(), D, Vx + j0 * vs, vs, false, dP.data(), nb);
        for (int64_t i = 0; i < m; ++i) {
          T *p = P.data() + i * nb, *dp = dP.data() + i * nb;
          probs(p, nb, scale, LA[x * m + i]);
          for (int64_t j = 0; j < nb; ++j) {
            if (km && !km[j0 + j]) p[j] = T(0);
            dp[j] = scale * p[j] * (dp[j] - rowdot[i]);
          }
        }
        gemm<T>(true, false, nb, D, m, P.data(), nb, dvs.data(), D, false, dVx + j0 * D, D);
        gemm<T>(false, false, m, D, nb, dP.data(), nb, Kx + j0 * ks, ks, true, dLx, D);
        gemm<T>(true, false, nb, D, m, dP.data(), nb, Lx, D, false, dKx + j0 * D, D);
      }

      // Routed experts: queries grouped by expert, as in the forward (members hold t * s + j).
      group_by_expert(R + x * Nq * s, qm, Nq, s, m, start.data(), members.data());
      for (int64_t e = 0; e < m; ++e) {
        const int64_t n_e = start[e + 1] - start[e];
        if (n_e == 0) continue;
        const int64_t* keys = E + (x * m + e) * topk;
        const int64_t* mem = members.data() + start[e];
        // dQb's nb rows added into the rows of their queries (slots sl); dKe, dVe into the key rows.
        const auto add_dq = [&](const int64_t* sl, int64_t nb) {
          for (int64_t i = 0; i < nb; ++i) {
            T* dqt = dQx + (sl[i] / s) * D;
            const T* g = dQb.data() + i * D;
            for (int64_t d = 0; d < D; ++d) dqt[d] += g[d];
          }
        };
        const auto add_dkv = [&] {
          for (int64_t i = 0; i < kk; ++i)
            for (int64_t d = 0; d < D; ++d) {
              dKx[keys[i] * D + d] += dKe[i * D + d];
              dVx[keys[i] * D + d] += dVe[i * D + d];
            }
        };
        // A small expert as in the forward: P^T and dP^T with its queries as lanes, every product in
        // register tiles reading rows in place (8-10% off the backward at N = 197, 2-3% at 1,025;
        // the same with BLAS-shaped buffers, tried first, measured no gain).
        if (n_e <= kQueryBlock && n_e * kk * D <= kSmallBackward) {
          using V = Vectorized<T>;
          const int64_t ld = whole_vectors<T>(n_e);
          T *Qt = Qb.data(), *dOt = dOb.data(), *Pt = P.data(), *dPt = dP.data();
          const auto qrow = [&](int64_t i) { return Qx + (mem[i] / s) * qs; };
          const auto dorow = [&](int64_t i) { return dOx + (mem[i] / s) * dos; };
          const auto krow = [&](int64_t j) { return Kx + keys[j] * ks; };
          const auto vrow = [&](int64_t j) { return Vx + keys[j] * vs; };
          rows_as_columns<T>(n_e, D, ld, T(1), qrow, Qt);
          rows_as_columns<T>(n_e, D, ld, T(1), dorow, dOt);
          small_gemm<T>(kk, ld, D, krow, 1, [&](int64_t d) { return Qt + d * ld; }, Pt, ld);
          small_gemm<T>(kk, ld, D, vrow, 1, [&](int64_t d) { return dOt + d * ld; }, dPt, ld);
          T lse_l[V::size()], dl_l[V::size()];
          const V vs0(scale);
          for (int64_t i0 = 0; i0 < ld; i0 += V::size()) {  // the queries are the lanes
            for (int64_t i = 0; i < V::size(); ++i) {
              const bool real = i0 + i < n_e;
              lse_l[i] = real ? LTx[mem[i0 + i] / s] : std::numeric_limits<T>::infinity();  // p = 0
              dl_l[i] = real ? delta[mem[i0 + i] / s] : T(0);
            }
            const V lse = V::loadu(lse_l), dl = V::loadu(dl_l);
            for (int64_t j = 0; j < kk; ++j) {
              const V pv = prob(V::loadu(Pt + j * ld + i0), vs0, lse);
              pv.store(Pt + j * ld + i0);
              (vs0 * pv * (V::loadu(dPt + j * ld + i0) - dl)).store(dPt + j * ld + i0);
            }
          }
          small_gemm<T>(n_e, D, kk, [&](int64_t i) { return dPt + i; }, ld, krow, dQb.data(), D);
          add_dq(mem, n_e);
          small_gemm<T>(kk, D, n_e, [&](int64_t j) { return dPt + j * ld; }, 1, qrow, dKe.data(), D);
          small_gemm<T>(kk, D, n_e, [&](int64_t j) { return Pt + j * ld; }, 1, dorow, dVe.data(), D);
          add_dkv();
          continue;
        }
        for (int64_t i = 0; i < kk; ++i) {
          std::copy(Kx + keys[i] * ks, Kx + keys[i] * ks + D, Ke.data() + i * D);
          std::copy(Vx + keys[i] * vs, Vx + keys[i] * vs + D, Ve.data() + i * D);
        }
        std::fill(dKe.begin(), dKe.end(), T(0));
        std::fill(dVe.begin(), dVe.end(), T(0));
        for (int64_t i0 = 0; i0 < n_e; i0 += kQueryBlock) {
          const int64_t nb = std::min(kQueryBlock, n_e - i0);
          for (int64_t i = 0; i < nb; ++i) {
            const int64_t t = mem[i0 + i] / s;
            std::copy(Qx + t * qs, Qx + t * qs + D, Qb.data() + i * D);
            std::copy(dOx + t * dos, dOx + t * dos + D, dOb.data() + i * D);
          }
          gemm<T>(false, true, nb, kk, D, Qb.data(), D, Ke.data(), D, false, P.data(), kk);
          gemm<T>(false, true, nb, kk, D, dOb.data(), D, Ve.data(), D, false, dP.data(), kk);
          for (int64_t i = 0; i < nb; ++i) {
            T *p = P.data() + i * kk, *dp = dP.data() + i * kk;
            const int64_t t = mem[i0 + i] / s;
            probs(p, kk, scale, LTx[t]);
            for (int64_t j = 0; j < kk; ++j) dp[j] = scale * p[j] * (dp[j] - delta[t]);
          }
          gemm<T>(false, false, nb, D, kk, dP.data(), kk, Ke.data(), D, false, dQb.data(), D);
          add_dq(mem + i0, nb);
          gemm<T>(true, false, kk, D, nb, dP.data(), kk, Qb.data(), D, true, dKe.data(), D);
          gemm<T>(true, false, kk, D, nb, P.data(), kk, dOb.data(), D, true, dVe.data(), D);
        }
        add_dkv();
      }

      if (bins) {  // landmarks pooled from q: their gradient (and any from outside) flows into dq
        if (dl_extra) {
          const T* extra = dl_extra->data_ptr<T>() + x * m * D;
          for (int64_t i = 0; i < m * D; ++i) dvs[i] = dLx[i] + extra[i];
          unpool_head(dvs.data(), m, D, bins, dQx);
        } else {
          unpool_head(dLx, m, D, bins, dQx);
        }
      }
    }
  });
}

// A 4-D tensor whose rows (the last dimension) are contiguous, in any layout of the others.
bool rows_contiguous(const at::Tensor& t) {
  return t.dim() == 4 && (t.stride(3) == 1 || t.size(3) == 1);
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& landmarks) {
  for (const auto* t : {&q, &k, &v, &landmarks}) {
    TORCH_CHECK(t->device().is_cpu() && rows_contiguous(*t),
                "mita fused: q, k, v, landmarks must be 4-D CPU tensors with contiguous rows (stride(-1) == 1)");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "mita fused: q, k, v, landmarks must share one dtype");
  }
  TORCH_CHECK(landmarks.is_contiguous(), "mita fused: landmarks must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, "mita fused: float32 or float64 only");
  // Every size is a divisor or a loop bound somewhere: an empty one is refused here, not met as a SIGFPE.
  TORCH_CHECK(q.numel() > 0 && k.numel() > 0 && landmarks.numel() > 0,
              "mita fused: every size of q (B, H, Nq, D), k, v (B, Hkv, Nk, D) and the landmarks (B, H, m, D) must "
              "be >= 1, got q ", q.sizes(), ", k ", k.sizes(), ", landmarks ", landmarks.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && H % k.size(1) == 0 && v.sizes() == k.sizes(),
              "mita fused: k and v must be (B, Hkv, Nk, D) with H a multiple of Hkv, got q ", q.sizes(), ", k ",
              k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(landmarks.size(0) == B && landmarks.size(1) == H && landmarks.size(3) == D,
              "mita fused: bad landmarks shape");
}

// scale and landmark_scale, positive and finite in q's dtype: the kernels scale differences of
// logits by them (exp_sum), which takes a positive factor.
void check_scales(double scale, double landmark_scale, at::ScalarType dtype) {
  for (const double s : {scale, landmark_scale}) {
    const double t = dtype == at::kFloat ? double(static_cast<float>(s)) : s;
    TORCH_CHECK(t > 0 && std::isfinite(t), "mita fused: scale and landmark_scale must be positive and finite in ",
                dtype, ", got ", scale, " and ", landmark_scale);
  }
}

// The data of a (B, N) bool padding mask (True = real token), or nullptr without one.
const bool* mask_data(const std::optional<at::Tensor>& mask, int64_t B, int64_t N, const char* name) {
  if (!mask.has_value()) return nullptr;
  TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous() && mask->dim() == 2 && mask->size(0) == B &&
                  mask->size(1) == N,
              "mita fused: ", name, " must be a contiguous (B, N) bool tensor");
  return mask->data_ptr<bool>();
}

// The bins of pool_head, checked against Nq and m; empty without them.
Bins bins_data(const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& tokens, int64_t Nq) {
  TORCH_CHECK(offsets.has_value() == tokens.has_value(), "mita fused: pool_offsets and pool_tokens go together");
  if (!offsets.has_value()) return {};
  for (const auto* t : {&*offsets, &*tokens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1 && t->device().is_cpu(),
                "mita fused: pool_offsets and pool_tokens must be contiguous 1-D int64 CPU tensors");
  const int64_t m = offsets->numel() - 1, *off = offsets->data_ptr<int64_t>(), *tok = tokens->data_ptr<int64_t>();
  TORCH_CHECK(m >= 1 && off[0] == 0 && off[m] == tokens->numel(), "mita fused: pool_offsets must run from 0 to the "
              "number of pool_tokens");
  for (int64_t i = 0; i < m; ++i) TORCH_CHECK(off[i + 1] > off[i], "mita fused: pooling bin ", i, " is empty");
  for (int64_t p = 0; p < off[m]; ++p)
    TORCH_CHECK(tok[p] >= 0 && tok[p] < Nq, "mita fused: pool_tokens must be in [0, Nq = ", Nq, ")");
  return {off, tok};
}

// Returns out, experts, routes, the landmarks (pooled here from q by the bins when none are given,
// else a copy of them), and for the backward: v~ (B, H, m, D), the log-sum-exps of s0*A per
// landmark (B, H, m) and of each query's joint softmax (B, H, Nq).
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& landmarks, const std::optional<at::Tensor>& key_mask,
                                const std::optional<at::Tensor>& query_mask, int64_t topk, int64_t num_routed,
                                double scale, double landmark_scale, const std::optional<at::Tensor>& pool_offsets,
                                const std::optional<at::Tensor>& pool_tokens) {
  const Bins bins = bins_data(pool_offsets, pool_tokens, q.dim() == 4 ? q.size(2) : 0);
  TORCH_CHECK(landmarks.has_value() != bool(bins), "mita fused: pass either landmarks or pooling bins");
  at::Tensor lm = landmarks.has_value()
                      ? landmarks->clone()
                      : at::empty({q.size(0), q.size(1), pool_offsets->numel() - 1, q.size(3)}, q.options());
  check_inputs(q, k, v, lm);
  check_scales(scale, landmark_scale, q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3), m = lm.size(2);
  const bool *km = mask_data(key_mask, B, k.size(2), "key_mask"), *qm = mask_data(query_mask, B, Nq, "query_mask");
  TORCH_CHECK(!bins || !qm, "mita fused: pooling bins take no query mask (pool the masked landmarks outside)");
  TORCH_CHECK(k.size(2) < std::numeric_limits<int32_t>::max(), "mita fused: at most 2^31 - 2 keys, got Nk = ",
              k.size(2));
  TORCH_CHECK(topk >= 1 && topk <= k.size(2) && num_routed >= 1 && num_routed <= m,
              "mita fused: topk must be in [1, Nk = ", k.size(2), "] and num_routed in [1, m = ", m, "], got topk = ",
              topk, ", num_routed = ", num_routed);
  const auto opts = q.options();
  at::Tensor out = at::empty({B, Nq, H, D}, opts).transpose(1, 2), v_shared = at::empty({B, H, m, D}, opts);
  at::Tensor lse_a = at::empty({B, H, m}, opts), lse_t = at::empty({B, H, Nq}, opts);
  at::Tensor experts = at::empty({B, H, m, topk}, opts.dtype(at::kLong));
  at::Tensor routes = at::empty({B, H, Nq, num_routed}, opts.dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mita_fused_forward", [&] {
    forward_impl<scalar_t>(q, k, v, lm, bins, km, qm, topk, num_routed, scale, landmark_scale, out, experts, routes,
                           v_shared, lse_a, lse_t);
  });
  return {out, experts, routes, lm, v_shared, lse_a, lse_t};
}

// Gradients of out with respect to q, k, v (padded keys' rows included, zero) and the landmarks.
// With pooling bins the landmarks were pooled from q: their gradient, plus `dlandmarks` (a
// gradient reaching them from outside), is added into dq.
std::vector<at::Tensor> backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& landmarks,
                                 const std::optional<at::Tensor>& key_mask, const std::optional<at::Tensor>& query_mask,
                                 const at::Tensor& experts, const at::Tensor& routes, const at::Tensor& out,
                                 const at::Tensor& v_shared, const at::Tensor& lse_a, const at::Tensor& lse_t,
                                 double scale, double landmark_scale, const std::optional<at::Tensor>& pool_offsets,
                                 const std::optional<at::Tensor>& pool_tokens,
                                 const std::optional<at::Tensor>& dlandmarks) {
  check_inputs(q, k, v, landmarks);
  check_scales(scale, landmark_scale, q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), Nk = k.size(2), D = q.size(3);
  const int64_t Nq = q.size(2), m = landmarks.size(2);
  const bool *km = mask_data(key_mask, B, Nk, "key_mask"), *qm = mask_data(query_mask, B, Nq, "query_mask");
  const Bins bins = bins_data(pool_offsets, pool_tokens, Nq);
  TORCH_CHECK(!bins || (pool_offsets->numel() == m + 1 && !qm),
              "mita fused: pooling bins must give the m landmarks and take no query mask");
  TORCH_CHECK(!dlandmarks.has_value() || (bins && dlandmarks->sizes() == landmarks.sizes() &&
                                          dlandmarks->scalar_type() == q.scalar_type() && dlandmarks->is_contiguous()),
              "mita fused: dlandmarks goes with pooling bins and must be contiguous, of the landmarks' shape and dtype");
  for (const auto* t : {&dout, &out, &v_shared, &lse_a, &lse_t})
    TORCH_CHECK((t == &dout || t == &out ? rows_contiguous(*t) : t->is_contiguous()) &&
                    t->scalar_type() == q.scalar_type(),
                "mita fused: dout and out must have contiguous rows, the other saved tensors be contiguous, all of "
                "q's dtype");
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() && v_shared.sizes() == landmarks.sizes() &&
                  lse_a.sizes() == at::IntArrayRef({B, H, m}) && lse_t.sizes() == at::IntArrayRef({B, H, Nq}),
              "mita fused: dout, out, v_shared, lse_a, lse_t do not match q and the landmarks");
  TORCH_CHECK(experts.scalar_type() == at::kLong && experts.is_contiguous() && experts.dim() == 4 &&
                  experts.size(0) == B && experts.size(1) == H && experts.size(2) == m && experts.size(3) >= 1 &&
                  experts.size(3) <= Nk && routes.scalar_type() == at::kLong && routes.is_contiguous() &&
                  routes.dim() == 4 && routes.size(0) == B && routes.size(1) == H && routes.size(2) == Nq &&
                  routes.size(3) >= 1 && routes.size(3) <= m,
              "mita fused: experts must be (B, H, m, 1 <= k <= Nk) and routes (B, H, Nq, 1 <= s <= m) int64");
  TORCH_CHECK(experts.numel() == 0 || (experts.min().item<int64_t>() >= 0 && experts.max().item<int64_t>() < Nk),
              "mita fused: expert key indices out of range");
  TORCH_CHECK(routes.numel() == 0 || (routes.min().item<int64_t>() >= 0 && routes.max().item<int64_t>() < m),
              "mita fused: routes out of range");
  at::Tensor dq = at::empty(q.sizes(), q.options()), dl = at::zeros_like(landmarks);
  at::Tensor dk = at::empty({B, H, Nk, D}, q.options()), dv = at::empty({B, H, Nk, D}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mita_fused_backward", [&] {
    backward_impl<scalar_t>(dout, q, k, v, landmarks, km, qm, experts, routes, out, v_shared, lse_a, lse_t, scale,
                            landmark_scale, bins, dlandmarks.has_value() ? &*dlandmarks : nullptr, dq, dk, dv, dl);
  });
  if (H != Hkv) {  // grouped-query heads: each kv head's gradient is the sum over its query heads
    dk = dk.view({B, Hkv, H / Hkv, Nk, D}).sum(2);
    dv = dv.view({B, Hkv, H / Hkv, Nk, D}).sum(2);
  }
  return {dq, dk, dv, dl};
}

}  // namespace

TORCH_LIBRARY(mita, m) {
  m.def(
      "fused_forward(Tensor q, Tensor k, Tensor v, Tensor? landmarks, Tensor? key_mask, Tensor? query_mask, "
      "int topk, int num_routed, float scale, float landmark_scale, Tensor? pool_offsets=None, "
      "Tensor? pool_tokens=None) -> Tensor[]");
  m.def(
      "fused_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor landmarks, Tensor? key_mask, "
      "Tensor? query_mask, Tensor experts, Tensor routes, Tensor out, Tensor v_shared, Tensor lse_a, "
      "Tensor lse_t, float scale, float landmark_scale, Tensor? pool_offsets=None, Tensor? pool_tokens=None, "
      "Tensor? dlandmarks=None) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(mita, CPU, m) {
  m.impl("fused_forward", &forward);
  m.impl("fused_backward", &backward);
}
