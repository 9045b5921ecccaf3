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
// Matrix products go to the BLAS that libtorch_cpu links (sgemm_/dgemm_); element-wise
// work uses ATen's vectorized types. Ties in top-k and routing go to the lower index.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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

// Row-major C (M x N) = alpha * op(A) op(B) + beta * C, op(A) is M x K, op(B) is K x N.
// Column-major BLAS sees the transposes: C^T = op(B)^T op(A)^T.
template <typename T>
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda, const T* B,
          int64_t ldb, T beta, T* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  const char a = ta ? 'T' : 'N', b = tb ? 'T' : 'N';
  const int m = N, n = M, k = K, la = ldb, lb = lda, lc = ldc;
  if constexpr (std::is_same_v<T, float>) {
    sgemm_(&b, &a, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
  } else {
    dgemm_(&b, &a, &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
  }
}

template <typename T>
inline Vectorized<T> vexp(const Vectorized<T>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

template <typename T>
T row_max(const T* x, int64_t n) {
  using V = Vectorized<T>;
  T mx = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  if (n >= V::size()) {
    V vm = V::loadu(x);
    for (j = V::size(); j + V::size() <= n; j += V::size()) vm = at::vec::maximum(vm, V::loadu(x + j));
    mx = at::vec::vec_reduce_all<T>([](V& p, V& q) { return at::vec::maximum(p, q); }, vm);
  }
  for (; j < n; ++j) mx = (std::isnan(x[j]) || x[j] > mx) ? x[j] : mx;
  return mx;
}

// x <- exp(a * x - mx) in place; returns the sum.
template <typename T>
T exp_sum(T* x, int64_t n, T a, T mx) {
  using V = Vectorized<T>;
  const V va(a), vm(mx);
  V vs(T(0));
  int64_t j = 0;
  for (; j + V::size() <= n; j += V::size()) {
    V e = vexp(V::loadu(x + j) * va - vm);
    e.store(x + j);
    vs = vs + e;
  }
  T sum = at::vec::vec_reduce_all<T>([](V& p, V& q) { return p + q; }, vs);
  for (; j < n; ++j) {
    x[j] = std::exp(a * x[j] - mx);
    sum += x[j];
  }
  return sum;
}

template <typename T>
void scale_row(T* x, int64_t n, T a) {
  at::vec::map([a](Vectorized<T> v) { return v * Vectorized<T>(a); }, x, x, n);
}

// x <- exp(a * x - max(a * x)) in place; returns (sum, max(a * x)).
template <typename T>
std::pair<T, T> exp_row(T* x, int64_t n, T a) {
  if (!(a > T(0))) {  // max(a * x) is a * min(x): scale first
    scale_row(x, n, a);
    a = T(1);
  }
  const T mx = a * row_max(x, n);
  return {exp_sum(x, n, a, mx), mx};
}

// Top-k of one row, streamed block by block: a min-heap of the k best (score, index) so far.
// "Worse" = lower score, or equal score and higher index, so ties keep the lower index.
template <typename T>
struct TopK {
  T* score;
  int64_t* index;
  int64_t size = 0, cap = 0;

  static bool worse(T s1, int64_t i1, T s2, int64_t i2) { return s1 < s2 || (s1 == s2 && i1 > i2); }

  void sift_down(int64_t p) {
    while (true) {
      int64_t c = 2 * p + 1, w = p;
      if (c < size && worse(score[c], index[c], score[w], index[w])) w = c;
      if (c + 1 < size && worse(score[c + 1], index[c + 1], score[w], index[w])) w = c + 1;
      if (w == p) return;
      std::swap(score[p], score[w]);
      std::swap(index[p], index[w]);
      p = w;
    }
  }

  void push(T s, int64_t i) {  // while filling: append and sift up
    int64_t c = size++;
    score[c] = s;
    index[c] = i;
    while (c > 0) {
      int64_t p = (c - 1) / 2;
      if (!worse(score[c], index[c], score[p], index[p])) break;
      std::swap(score[c], score[p]);
      std::swap(index[c], index[p]);
      c = p;
    }
  }

  // Offer keys j0 .. j0+n-1 with scores x; `real` (or null) marks the keys that take part.
  void offer(const T* x, int64_t n, int64_t j0, const bool* real) {
    int64_t j = 0;
    for (; j < n && size < cap; ++j)
      if (!real || real[j]) push(x[j], j0 + j);
    for (; j < n; ++j) {
      if (x[j] > score[0] && (!real || real[j])) {  // keys come in index order: an equal score loses
        score[0] = x[j];
        index[0] = j0 + j;
        sift_down(0);
      }
    }
  }

  // Best first, like torch.topk(sorted=True).
  void sorted_indices(int64_t* out) {
    std::vector<std::pair<T, int64_t>> v(size);
    for (int64_t i = 0; i < size; ++i) v[i] = {score[i], index[i]};
    std::sort(v.begin(), v.end(), [](const auto& p, const auto& q) { return worse(q.first, q.second, p.first, p.second); });
    for (int64_t i = 0; i < size; ++i) out[i] = v[i].second;
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

constexpr int64_t kKeyBlock = 512, kQueryBlock = 256;  // measured best of 256-1024 / 64-512 at N = 16,384

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lm,
                  const bool* key_mask, const bool* query_mask, int64_t topk, int64_t s, double scale_,
                  double landmark_scale_, at::Tensor& out, at::Tensor& experts, at::Tensor& routes,
                  at::Tensor& v_shared, at::Tensor& lse_a, at::Tensor& lse_t) {
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Nk = k.size(2), m = lm.size(2), G = H / Hkv, X = B * H;
  const T scale = static_cast<T>(scale_), lscale = static_cast<T>(landmark_scale_);
  const T* Q = q.data_ptr<T>();
  const T* K = k.data_ptr<T>();
  const T* Vv = v.data_ptr<T>();
  const T* L = lm.data_ptr<T>();
  T* O = out.data_ptr<T>();
  int64_t* E = experts.data_ptr<int64_t>();
  int64_t* R = routes.data_ptr<int64_t>();
  const auto kv_offset = [&](int64_t x) { return ((x / H) * Hkv + (x % H) / G) * Nk * D; };
  std::vector<int64_t> n_real(B, Nk);
  if (key_mask)
    for (int64_t b = 0; b < B; ++b) n_real[b] = std::count(key_mask + b * Nk, key_mask + (b + 1) * Nk, true);
  const auto opts = q.options();
  at::Tensor lse_shared = at::empty({X, Nq}, opts);
  T* VS = v_shared.data_ptr<T>();
  T* LA = lse_a.data_ptr<T>();  // log-sum-exp of each landmark's row of s0*A
  T* LT = lse_t.data_ptr<T>();  // log-sum-exp of each query's joint softmax (step 6)
  T* LSE = lse_shared.data_ptr<T>();
  const T ninf = -std::numeric_limits<T>::infinity();

  // A: shared-expert values and the experts' keys, per (head, block of landmark rows).
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>((at::get_num_threads() + X - 1) / X, m / 16));
  const int64_t rows = (m + chunks - 1) / chunks;
  at::parallel_for(0, X * chunks, 1, [&](int64_t begin, int64_t end) {
    const SingleThreadedBlas blas;
    std::vector<T> S(rows * kKeyBlock), mx(rows), sum(rows), hs(rows * topk);
    std::vector<int64_t> hi(rows * topk);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t x = item / chunks, r0 = (item % chunks) * rows, nr = std::min(rows, m - r0);
      if (nr <= 0) continue;
      const int64_t b = x / H, kk = std::min(topk, n_real[b]);
      const T* Lx = L + (x * m + r0) * D;
      const T* Kx = K + kv_offset(x);
      const T* Vx = Vv + kv_offset(x);
      const bool* km = key_mask ? key_mask + b * Nk : nullptr;
      T* acc = VS + (x * m + r0) * D;
      std::fill(acc, acc + nr * D, T(0));
      std::fill(mx.begin(), mx.end(), ninf);
      std::fill(sum.begin(), sum.end(), T(0));
      std::vector<TopK<T>> heaps(nr);
      for (int64_t r = 0; r < nr; ++r) heaps[r] = {hs.data() + r * topk, hi.data() + r * topk, 0, kk};
      for (int64_t j0 = 0; j0 < Nk; j0 += kKeyBlock) {
        const int64_t nb = std::min(kKeyBlock, Nk - j0);
        gemm<T>(false, true, nr, nb, D, T(1), Lx, D, Kx + j0 * D, D, T(0), S.data(), nb);
        for (int64_t r = 0; r < nr; ++r) {
          T* row = S.data() + r * nb;
          heaps[r].offer(row, nb, j0, km ? km + j0 : nullptr);
          if (!(scale > T(0))) scale_row(row, nb, scale);
          const T a = scale > T(0) ? scale : T(1);
          if (km)
            for (int64_t j = 0; j < nb; ++j)
              if (!km[j0 + j]) row[j] = ninf;
          const T nm = std::max(mx[r], a * row_max(row, nb));
          if (nm == ninf) {  // every key so far padded
            std::fill(row, row + nb, T(0));
            continue;
          }
          const T alpha = mx[r] == ninf ? T(0) : std::exp(mx[r] - nm);
          sum[r] = sum[r] * alpha + exp_sum(row, nb, a, nm);
          if (alpha != T(1)) scale_row(acc + r * D, D, alpha);
          mx[r] = nm;
        }
        gemm<T>(false, false, nr, D, nb, T(1), S.data(), nb, Vx + j0 * D, D, T(1), acc, D);
      }
      for (int64_t r = 0; r < nr; ++r) {
        scale_row(acc + r * D, D, T(1) / sum[r]);
        LA[x * m + r0 + r] = mx[r] + std::log(sum[r]);
        int64_t* e = E + (x * m + r0 + r) * topk;
        heaps[r].sorted_indices(e);
        for (int64_t i = kk, j = 0; i < topk; ++i, ++j) {  // a short sequence: padded keys, in order
          while (km[j]) ++j;
          e[i] = j;
        }
      }
    }
  });

  // B: gate, routes and the shared branch, per (head, block of queries).
  const int64_t qblocks = (Nq + kQueryBlock - 1) / kQueryBlock;
  at::parallel_for(0, X * qblocks, 1, [&](int64_t begin, int64_t end) {
    const SingleThreadedBlas blas;
    std::vector<T> Gt(kQueryBlock * m), g(m);
    std::vector<int64_t> order(m);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t x = item / qblocks, t0 = (item % qblocks) * kQueryBlock, nq = std::min(kQueryBlock, Nq - t0);
      const bool* qm = query_mask ? query_mask + (x / H) * Nq : nullptr;
      gemm<T>(false, true, nq, m, D, T(1), Q + (x * Nq + t0) * D, D, L + x * m * D, D, T(0), Gt.data(), m);
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t t = t0 + i;
        T* row = Gt.data() + i * m;
        int64_t* route = R + (x * Nq + t) * s;
        if (qm && !qm[t]) {  // padded query: no routes of its own, zero output
          for (int64_t j = 0; j < s; ++j) route[j] = j;
          std::fill(row, row + m, T(0));
          LSE[x * Nq + t] = ninf;
          LT[x * Nq + t] = T(0);
          continue;
        }
        if (s == 1) {
          int64_t best = 0;
          for (int64_t e = 1; e < m; ++e)
            if (row[e] > row[best]) best = e;
          route[0] = best;
        } else {
          for (int64_t e = 0; e < m; ++e) order[e] = e;
          std::partial_sort(order.begin(), order.begin() + s, order.end(),
                            [row](int64_t a, int64_t c) { return row[a] > row[c] || (row[a] == row[c] && a < c); });
          std::copy(order.begin(), order.begin() + s, route);
        }
        const auto [sm, rm] = exp_row(row, m, lscale);
        scale_row(row, m, T(1) / sm);
        LSE[x * Nq + t] = rm + std::log(sm);
      }
      gemm<T>(false, false, nq, D, m, T(1), Gt.data(), m, VS + x * m * D, D, T(0), O + (x * Nq + t0) * D, D);
    }
  });

  // C: queries grouped by expert; each expert's keys attend its queries, merged into out.
  at::Tensor count_t = at::empty({X, m + 1}, opts.dtype(at::kLong));
  at::Tensor members_t = at::empty({X, Nq * s}, opts.dtype(at::kLong));
  int64_t* start = count_t.data_ptr<int64_t>();
  int64_t* members = members_t.data_ptr<int64_t>();
  at::parallel_for(0, X, 1, [&](int64_t begin, int64_t end) {
    for (int64_t x = begin; x < end; ++x)
      group_by_expert(R + x * Nq * s, query_mask ? query_mask + (x / H) * Nq : nullptr, Nq, s, m,
                      start + x * (m + 1), members + x * Nq * s);
  });
  at::Tensor routed_out, routed_lse;  // s > 1: each (query, route) result, merged after
  if (s > 1) {
    routed_out = at::empty({X, Nq * s, D}, opts);
    routed_lse = at::empty({X, Nq * s}, opts);
  }
  at::parallel_for(0, X * m, 1, [&](int64_t begin, int64_t end) {
    const SingleThreadedBlas blas;
    std::vector<T> Ke(topk * D), Ve(topk * D), Qb(kQueryBlock * D), Sb(kQueryBlock * topk), Ob(kQueryBlock * D),
        lse(kQueryBlock);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t x = item / m, e = item % m;
      const int64_t* st = start + x * (m + 1);
      const int64_t n_e = st[e + 1] - st[e];
      if (n_e == 0) continue;
      const int64_t kk = std::min(topk, n_real[x / H]);
      const int64_t* keys = E + (x * m + e) * topk;
      const T* Kx = K + kv_offset(x);
      const T* Vx = Vv + kv_offset(x);
      for (int64_t i = 0; i < kk; ++i) {
        std::copy(Kx + keys[i] * D, Kx + (keys[i] + 1) * D, Ke.data() + i * D);
        std::copy(Vx + keys[i] * D, Vx + (keys[i] + 1) * D, Ve.data() + i * D);
      }
      const int64_t* mem = members + x * Nq * s + st[e];
      for (int64_t i0 = 0; i0 < n_e; i0 += kQueryBlock) {
        const int64_t nb = std::min(kQueryBlock, n_e - i0);
        for (int64_t i = 0; i < nb; ++i) {
          const T* src = Q + (x * Nq + mem[i0 + i] / s) * D;
          std::copy(src, src + D, Qb.data() + i * D);
        }
        gemm<T>(false, true, nb, kk, D, T(1), Qb.data(), D, Ke.data(), D, T(0), Sb.data(), kk);
        for (int64_t i = 0; i < nb; ++i) {
          T* row = Sb.data() + i * kk;
          const auto [sm, rm] = exp_row(row, kk, scale);
          scale_row(row, kk, T(1) / sm);
          lse[i] = rm + std::log(sm);
        }
        gemm<T>(false, false, nb, D, kk, T(1), Sb.data(), kk, Ve.data(), D, T(0), Ob.data(), D);
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t slot = mem[i0 + i], t = slot / s;
          if (s == 1) {  // out = lerp(out_shared, out_routed, sigmoid(lse_r - lse_shared))
            const T a = LSE[x * Nq + t], c = lse[i], w = T(1) / (T(1) + std::exp(a - c));
            LT[x * Nq + t] = std::max(a, c) + std::log1p(std::exp(-std::abs(a - c)));
            T* o = O + (x * Nq + t) * D;
            const T* r = Ob.data() + i * D;
            for (int64_t d = 0; d < D; ++d) o[d] += w * (r[d] - o[d]);
          } else {
            std::copy(Ob.data() + i * D, Ob.data() + (i + 1) * D, routed_out.data_ptr<T>() + (x * Nq * s + slot) * D);
            routed_lse.data_ptr<T>()[x * Nq * s + slot] = lse[i];
          }
        }
      }
    }
  });
  if (s == 1) return;
  // Merge for s > 1: weights softmax([lse_shared, lse_r1 .. lse_rs]).
  const T* RO = routed_out.data_ptr<T>();
  const T* RL = routed_lse.data_ptr<T>();
  at::parallel_for(0, X * Nq, 256, [&](int64_t begin, int64_t end) {
    std::vector<T> w(s + 1);
    for (int64_t xt = begin; xt < end; ++xt) {
      if (query_mask && !query_mask[(xt / (H * Nq)) * Nq + xt % Nq]) continue;
      w[0] = LSE[xt];
      std::copy(RL + xt * s, RL + (xt + 1) * s, w.begin() + 1);
      const T wm = *std::max_element(w.begin(), w.end());
      T ws = 0;
      for (auto& a : w) ws += (a = std::exp(a - wm));
      LT[xt] = wm + std::log(ws);
      T* o = O + xt * D;
      for (int64_t d = 0; d < D; ++d) {
        T a = w[0] * o[d];
        for (int64_t j = 0; j < s; ++j) a += w[j + 1] * RO[(xt * s + j) * D + d];
        o[d] = a / ws;
      }
    }
  });
}

// Backward of the joint softmax of step 6 and of V~ = softmax(s0 L K^T) V, per head x (one
// task per head: dq, dlandmarks and the head's dk, dv rows have one writer). p are the joint
// probabilities exp(logit - lse_t); with delta = <dout, out> per query, d logit = p (dp - delta).
template <typename T>
void backward_impl(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& lm, const bool* key_mask, const bool* query_mask, const at::Tensor& experts,
                   const at::Tensor& routes, const at::Tensor& out, const at::Tensor& v_shared,
                   const at::Tensor& lse_a, const at::Tensor& lse_t, double scale_, double landmark_scale_,
                   at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dl) {
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Nk = k.size(2), m = lm.size(2), G = H / Hkv, X = B * H;
  const int64_t topk = experts.size(3), s = routes.size(3);
  const T scale = static_cast<T>(scale_), lscale = static_cast<T>(landmark_scale_);
  const T *dO = dout.data_ptr<T>(), *Q = q.data_ptr<T>(), *K = k.data_ptr<T>(), *Vv = v.data_ptr<T>();
  const T *L = lm.data_ptr<T>(), *O = out.data_ptr<T>(), *VS = v_shared.data_ptr<T>();
  const T *LA = lse_a.data_ptr<T>(), *LT = lse_t.data_ptr<T>();
  const int64_t *E = experts.data_ptr<int64_t>(), *R = routes.data_ptr<int64_t>();
  T *dQ = dq.data_ptr<T>(), *dK = dk.data_ptr<T>(), *dV = dv.data_ptr<T>(), *dL = dl.data_ptr<T>();
  const auto kv_offset = [&](int64_t x) { return ((x / H) * Hkv + (x % H) / G) * Nk * D; };

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
      const T *Qx = Q + x * Nq * D, *dOx = dO + x * Nq * D, *Ox = O + x * Nq * D, *Lx = L + x * m * D;
      const T *VSx = VS + x * m * D, *Kx = K + kv_offset(x), *Vx = Vv + kv_offset(x), *LTx = LT + x * Nq;
      T *dQx = dQ + x * Nq * D, *dKx = dK + x * Nk * D, *dVx = dV + x * Nk * D, *dLx = dL + x * m * D;
      for (int64_t t = 0; t < Nq; ++t)
        delta[t] = (qm && !qm[t]) ? T(0) : at::vec::map2_reduce_all<T>(
            [](Vectorized<T> a, Vectorized<T> c) { return a * c; }, [](Vectorized<T> a, Vectorized<T> c) { return a + c; },
            dOx + t * D, Ox + t * D, D);
      std::fill(dvs.begin(), dvs.end(), T(0));

      // Shared expert: logits ls * q.q~, values v~.
      for (int64_t t0 = 0; t0 < Nq; t0 += kQueryBlock) {
        const int64_t nq = std::min(kQueryBlock, Nq - t0);
        gemm<T>(false, true, nq, m, D, T(1), Qx + t0 * D, D, Lx, D, T(0), P.data(), m);
        gemm<T>(false, true, nq, m, D, T(1), dOx + t0 * D, D, VSx, D, T(0), dP.data(), m);
        for (int64_t i = 0; i < nq; ++i) {
          T *p = P.data() + i * m, *dp = dP.data() + i * m;
          if (qm && !qm[t0 + i]) {
            std::fill(p, p + m, T(0));
            std::fill(dp, dp + m, T(0));
            continue;
          }
          exp_sum(p, m, lscale, LTx[t0 + i]);
          for (int64_t e = 0; e < m; ++e) dp[e] = lscale * p[e] * (dp[e] - delta[t0 + i]);
        }
        gemm<T>(false, false, nq, D, m, T(1), dP.data(), m, Lx, D, T(0), dQx + t0 * D, D);
        gemm<T>(true, false, m, D, nq, T(1), dP.data(), m, Qx + t0 * D, D, T(1), dLx, D);
        gemm<T>(true, false, m, D, nq, T(1), P.data(), m, dOx + t0 * D, D, T(1), dvs.data(), D);
      }

      // Routed experts: queries grouped by expert, as in the forward (members hold t * s + j).
      group_by_expert(R + x * Nq * s, qm, Nq, s, m, start.data(), members.data());
      for (int64_t e = 0; e < m; ++e) {
        const int64_t n_e = start[e + 1] - start[e];
        if (n_e == 0) continue;
        const int64_t* keys = E + (x * m + e) * topk;
        for (int64_t i = 0; i < kk; ++i) {
          std::copy(Kx + keys[i] * D, Kx + (keys[i] + 1) * D, Ke.data() + i * D);
          std::copy(Vx + keys[i] * D, Vx + (keys[i] + 1) * D, Ve.data() + i * D);
        }
        std::fill(dKe.begin(), dKe.end(), T(0));
        std::fill(dVe.begin(), dVe.end(), T(0));
        const int64_t* mem = members.data() + start[e];
        for (int64_t i0 = 0; i0 < n_e; i0 += kQueryBlock) {
          const int64_t nb = std::min(kQueryBlock, n_e - i0);
          for (int64_t i = 0; i < nb; ++i) {
            const int64_t t = mem[i0 + i] / s;
            std::copy(Qx + t * D, Qx + (t + 1) * D, Qb.data() + i * D);
            std::copy(dOx + t * D, dOx + (t + 1) * D, dOb.data() + i * D);
          }
          gemm<T>(false, true, nb, kk, D, T(1), Qb.data(), D, Ke.data(), D, T(0), P.data(), kk);
          gemm<T>(false, true, nb, kk, D, T(1), dOb.data(), D, Ve.data(), D, T(0), dP.data(), kk);
          for (int64_t i = 0; i < nb; ++i) {
            T *p = P.data() + i * kk, *dp = dP.data() + i * kk;
            const int64_t t = mem[i0 + i] / s;
            exp_sum(p, kk, scale, LTx[t]);
            for (int64_t j = 0; j < kk; ++j) dp[j] = scale * p[j] * (dp[j] - delta[t]);
          }
          gemm<T>(false, false, nb, D, kk, T(1), dP.data(), kk, Ke.data(), D, T(0), dQb.data(), D);
          for (int64_t i = 0; i < nb; ++i) {
            T* dqt = dQx + (mem[i0 + i] / s) * D;
            const T* g = dQb.data() + i * D;
            for (int64_t d = 0; d < D; ++d) dqt[d] += g[d];
          }
          gemm<T>(true, false, kk, D, nb, T(1), dP.data(), kk, Qb.data(), D, T(1), dKe.data(), D);
          gemm<T>(true, false, kk, D, nb, T(1), P.data(), kk, dOb.data(), D, T(1), dVe.data(), D);
        }
        for (int64_t i = 0; i < kk; ++i)
          for (int64_t d = 0; d < D; ++d) {
            dKx[keys[i] * D + d] += dKe[i * D + d];
            dVx[keys[i] * D + d] += dVe[i * D + d];
          }
      }

      // Shared values v~ = softmax(s0 A) V, by key blocks: P_A recomputed from its log-sum-exp.
      for (int64_t i = 0; i < m; ++i)
        rowdot[i] = at::vec::map2_reduce_all<T>(
            [](Vectorized<T> a, Vectorized<T> c) { return a * c; }, [](Vectorized<T> a, Vectorized<T> c) { return a + c; },
            dvs.data() + i * D, VSx + i * D, D);
      for (int64_t j0 = 0; j0 < Nk; j0 += kKeyBlock) {
        const int64_t nb = std::min(kKeyBlock, Nk - j0);
        gemm<T>(false, true, m, nb, D, T(1), Lx, D, Kx + j0 * D, D, T(0), P.data(), nb);
        gemm<T>(false, true, m, nb, D, T(1), dvs.data(), D, Vx + j0 * D, D, T(0), dP.data(), nb);
        for (int64_t i = 0; i < m; ++i) {
          T *p = P.data() + i * nb, *dp = dP.data() + i * nb;
          exp_sum(p, nb, scale, LA[x * m + i]);
          for (int64_t j = 0; j < nb; ++j) {
            if (km && !km[j0 + j]) p[j] = T(0);
            dp[j] = scale * p[j] * (dp[j] - rowdot[i]);
          }
        }
        gemm<T>(true, false, nb, D, m, T(1), P.data(), nb, dvs.data(), D, T(1), dVx + j0 * D, D);
        gemm<T>(false, false, m, D, nb, T(1), dP.data(), nb, Kx + j0 * D, D, T(1), dLx, D);
        gemm<T>(true, false, nb, D, m, T(1), dP.data(), nb, Lx, D, T(1), dKx + j0 * D, D);
      }
    }
  });
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& landmarks) {
  for (const auto* t : {&q, &k, &v, &landmarks}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->dim() == 4,
                "mita fused: q, k, v, landmarks must be contiguous 4-D CPU tensors");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "mita fused: q, k, v, landmarks must share one dtype");
  }
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

// The data of a (B, N) bool padding mask (True = real token), or nullptr without one.
const bool* mask_data(const std::optional<at::Tensor>& mask, int64_t B, int64_t N, const char* name) {
  if (!mask.has_value()) return nullptr;
  TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous() && mask->dim() == 2 && mask->size(0) == B &&
                  mask->size(1) == N,
              "mita fused: ", name, " must be a contiguous (B, N) bool tensor");
  return mask->data_ptr<bool>();
}

// Returns out, experts, routes, and for the backward: v~ (B, H, m, D), the log-sum-exps of
// s0*A per landmark (B, H, m) and of each query's joint softmax (B, H, Nq).
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& landmarks, const std::optional<at::Tensor>& key_mask,
                                const std::optional<at::Tensor>& query_mask, int64_t topk, int64_t num_routed,
                                double scale, double landmark_scale) {
  check_inputs(q, k, v, landmarks);
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3), m = landmarks.size(2);
  const bool *km = mask_data(key_mask, B, k.size(2), "key_mask"), *qm = mask_data(query_mask, B, Nq, "query_mask");
  TORCH_CHECK(topk >= 1 && topk <= k.size(2) && num_routed >= 1 && num_routed <= m,
              "mita fused: topk must be in [1, Nk = ", k.size(2), "] and num_routed in [1, m = ", m, "], got topk = ",
              topk, ", num_routed = ", num_routed);
  const auto opts = q.options();
  at::Tensor out = at::empty_like(q), v_shared = at::empty({B, H, m, D}, opts);
  at::Tensor lse_a = at::empty({B, H, m}, opts), lse_t = at::empty({B, H, Nq}, opts);
  at::Tensor experts = at::empty({B, H, m, topk}, opts.dtype(at::kLong));
  at::Tensor routes = at::empty({B, H, Nq, num_routed}, opts.dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mita_fused_forward", [&] {
    forward_impl<scalar_t>(q, k, v, landmarks, km, qm, topk, num_routed, scale, landmark_scale, out, experts, routes,
                           v_shared, lse_a, lse_t);
  });
  return {out, experts, routes, v_shared, lse_a, lse_t};
}

// Gradients of out with respect to q, k, v (padded keys' rows included, zero) and the landmarks.
std::vector<at::Tensor> backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& landmarks,
                                 const std::optional<at::Tensor>& key_mask, const std::optional<at::Tensor>& query_mask,
                                 const at::Tensor& experts, const at::Tensor& routes, const at::Tensor& out,
                                 const at::Tensor& v_shared, const at::Tensor& lse_a, const at::Tensor& lse_t,
                                 double scale, double landmark_scale) {
  check_inputs(q, k, v, landmarks);
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), Nk = k.size(2), D = q.size(3);
  const int64_t Nq = q.size(2), m = landmarks.size(2);
  const bool *km = mask_data(key_mask, B, Nk, "key_mask"), *qm = mask_data(query_mask, B, Nq, "query_mask");
  for (const auto* t : {&dout, &out, &v_shared, &lse_a, &lse_t})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == q.scalar_type(),
                "mita fused: dout and the saved tensors must be contiguous and of q's dtype");
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
  at::Tensor dq = at::empty_like(q), dl = at::zeros_like(landmarks);
  at::Tensor dk = at::zeros({B, H, Nk, D}, q.options()), dv = at::zeros({B, H, Nk, D}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mita_fused_backward", [&] {
    backward_impl<scalar_t>(dout, q, k, v, landmarks, km, qm, experts, routes, out,
                            v_shared, lse_a, lse_t, scale, landmark_scale, dq, dk, dv, dl);
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
      "fused_forward(Tensor q, Tensor k, Tensor v, Tensor landmarks, Tensor? key_mask, Tensor? query_mask, "
      "int topk, int num_routed, float scale, float landmark_scale) -> Tensor[]");
  m.def(
      "fused_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor landmarks, Tensor? key_mask, "
      "Tensor? query_mask, Tensor experts, Tensor routes, Tensor out, Tensor v_shared, Tensor lse_a, "
      "Tensor lse_t, float scale, float landmark_scale) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(mita, CPU, m) {
  m.impl("fused_forward", &forward);
  m.impl("fused_backward", &backward);
}
