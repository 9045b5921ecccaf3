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

// n rounded up to whole vectors of T (buffers read and written a vector at a time).
template <typename T>
constexpr int64_t whole_vectors(int64_t n) {
  constexpr int64_t w = Vectorized<T>::size();
  return (n + w - 1) / w * w;
}

}  // namespace
