// Vectorised row helpers: exp, max, the softmax of a row and its log-sum-exp.
// Part of the fused MiTA CPU kernel (fused_cpu.cpp, one translation unit; see README.md here).

#pragma once

#include "common.h"

namespace {

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

// Half precision. The kernels take bfloat16 and float16 q, k, v (and dout) and compute in float32
// (Compute<In>: float for them, the type itself for float and double): every read of an input row
// goes through load_as or to_compute, which convert per vector or per block into float32 scratch
// (bfloat16 by a shift, float16 by F16C's vcvtph2ps, both through at::vec::load_to_float), and the
// results are written back by from_compute (round to nearest even). For float and double they are
// plain loads and copies.
template <typename In>
using Compute = std::conditional_t<std::is_same_v<In, double>, double, float>;

// n <= W elements of p as a vector of T, the missing lanes zero.
template <typename T, typename In>
inline Vectorized<T> load_as(const In* p, int64_t n = Vectorized<T>::size()) {
  using V = Vectorized<T>;
  if constexpr (std::is_same_v<T, In>) {
    return n == V::size() ? V::loadu(p) : V::loadu(p, n);
  } else {
    V x;
    if (n == V::size()) {
      at::vec::load_to_float(p, x);
    } else {
      T tmp[V::size()] = {};
      for (int64_t i = 0; i < n; ++i) tmp[i] = static_cast<T>(p[i]);
      x = V::loadu(tmp);
    }
    return x;
  }
}

// dst[0 .. n) = src[0 .. n) as T.
template <typename T, typename In>
void to_compute(const In* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, In>) {
    std::copy(src, src + n, dst);
  } else {
    using V = Vectorized<T>;
    int64_t j = 0;
    for (; j + V::size() <= n; j += V::size()) load_as<T>(src + j).store(dst + j);
    for (; j < n; ++j) dst[j] = static_cast<T>(src[j]);
  }
}

// dst[0 .. n) = src[0 .. n) rounded to In.
template <typename In, typename T>
void from_compute(const T* src, In* dst, int64_t n) {
  if constexpr (std::is_same_v<T, In>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// from_compute with non-temporal stores where dst is 64-byte aligned and n a whole number of
// cache lines (AVX-512 builds): an output row written once and not read again by the kernel, so
// its lines are not read for ownership first. The caller calls stream_fence() before its task ends.
template <typename In, typename T>
void stream_from_compute(const T* src, In* dst, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  constexpr int64_t L = 64 / sizeof(In);
  if (reinterpret_cast<uintptr_t>(dst) % 64 == 0 && n % L == 0) {
    for (int64_t i = 0; i < n; i += L) {
      alignas(64) In line[L];
      const In* from = line;
      if constexpr (std::is_same_v<T, In>) from = src + i;
      else at::vec::convert(src + i, line, L);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(from));
    }
    return;
  }
#endif
  from_compute(src, dst, n);
}

// Orders stream_from_compute's non-temporal stores before the task's later writes and its end.
inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX512)
  _mm_sfence();
#endif
}

// n rows of In (row i at X + i * ld) as T: X itself when In is T, else the rows converted into buf
// (n x D, ld becomes D). The operand of a product read in place, or from scratch.
template <typename T, typename In>
const T* rows_as(const In* X, int64_t n, int64_t D, int64_t& ld, T* buf) {
  if constexpr (std::is_same_v<T, In>) {
    return X;
  } else {
    for (int64_t i = 0; i < n; ++i) to_compute(X + i * ld, buf + i * D, D);
    ld = D;
    return buf;
  }
}

// The dot product of two rows of n elements, in T.
template <typename T, typename In>
T row_dot(const In* a, const In* b, int64_t n) {
  using V = Vectorized<T>;
  V acc(T(0));
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) acc = at::vec::fmadd(load_as<T>(a + j), load_as<T>(b + j), acc);
  if (j < n) acc = at::vec::fmadd(load_as<T>(a + j, n - j), load_as<T>(b + j, n - j), acc);
  return at::vec::vec_reduce_all<T>([](V& p, V& q) { return p + q; }, acc);
}

// n rounded up to whole vectors of T (buffers read and written a vector at a time).
template <typename T>
constexpr int64_t whole_vectors(int64_t n) {
  constexpr int64_t w = Vectorized<T>::size();
  return (n + w - 1) / w * w;
}

// The row stride of a scratch matrix of n columns: whole vectors, one vector more where a row
// would be a multiple of 1 KiB. Rows 1 or 2 KiB apart fall into the same few L1 sets (4 KiB a
// way on every x86 core we met), so a pass down a column (a transpose, a softmax over the rows)
// evicted its own lines: transposing a 512 x 64 block took 13-16 us against 6.5-7 us padded (Zen 3).
template <typename T>
constexpr int64_t padded_ld(int64_t n) {
  const int64_t ld = whole_vectors<T>(n);
  return ld * int64_t(sizeof(T)) % 1024 == 0 ? ld + Vectorized<T>::size() : ld;
}

}  // namespace
