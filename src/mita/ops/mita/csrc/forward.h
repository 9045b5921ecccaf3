// The forward: phases A (experts, shared values), B (gate, shared branch), C (routed experts) and the merge.
// Part of the fused MiTA CPU kernel (fused_cpu.cpp, one translation unit; see README.md here).

#pragma once

#include "products.h"
#include "rows.h"
#include "topk.h"
#include "merge.h"
#include "memory.h"

namespace {

constexpr int64_t kKeyBlock = 512, kQueryBlock = 256;  // measured best of 256-1024 / 64-512 at N = 16,384
// The gate's softmax runs with W queries as the lanes up to rows of this many gates (padded): at
// N = 197 (m = 25) 0.945 of the forward by rows (copy 0.979); at m = 49 and 64 (rows of 64) no gain
// or 2% slower (Zen 4, 21 rounds).
constexpr int64_t kLanesUpTo = 32;
// A head whose q, k and v fit in this many bytes (about L2) runs all its phases in one task, so
// small heads (vision sizes) pay no per-phase scheduling and meet their data in cache; larger
// heads split each phase across the threads.
constexpr int64_t kSmallHead = int64_t(1) << 20;

// The forward of one call: the phases of the header as functions of (head, block), scheduled by
// forward_impl either head by head (small heads) or phase by phase (large ones). q, k, v are of
// type In, computed in T (float for bfloat16 and float16: see Compute in vec.h); out is written
// in T into O, then into OUT: a small head's rows (In not T) rounded after the head, a large head's
// each where it is last merged.
template <typename T, typename In>
struct Forward {
  static constexpr bool kHalf = !std::is_same_v<T, In>;
  // bfloat16 inputs multiplied as bfloat16 (kBf16Products, products.h); bf16_path() says whether this
  // call does (`products`, set once per call by forward_impl).
  static constexpr bool kBf16 = kBf16Products && std::is_same_v<In, bf16>;
  bool bf16_path() const { return kBf16 && products; }
  using Key = typename TopK<T>::S;
  int64_t H, Nq, D, Hkv, Nk, m, G, topk, s;
  T scale, lscale;
  const In *Q, *K, *Vv;
  Rows qr, kr, vr, outr;  // the layouts of q, k, v, out
  T* L;  // the landmarks: given, or pooled here from Q by `bins`
  Bins bins;
  const bool *key_mask, *query_mask;
  T *O, *VS, *LA, *LT, *LSE, *RO, *RL;
  In* OUT;  // the output: O itself for a small head in float32
  int64_t *E, *R, *start, *members;
  std::vector<int64_t> n_real;
  bool by_head = false;  // run head by head (small heads), its rows in cache
  bool products = false;  // bfloat16 products: kBf16, D even (query rows read in place), oneDNN on
  // Half precision, a small head by bfloat16 products: its key and value rows also in float32 (rows D
  // apart), read in place by the small routed experts; where null, each converts its own kk rows.
  const T *Kf = nullptr, *Vf = nullptr;
  // bfloat16 products on large heads: each head's shared operands packed once (pack_shared), X
  // heads of shared_size(); null: head() packs a small head's into its scratch (Scratch::Hs).
  bf16* shared = nullptr;
  // Merged duplicate keys (merge_duplicates): each key's logit offset, (B, Hkv, Nk), -inf on the copies
  // a group's first key stands for and on padded keys; key_mask is then per kv head (B, Hkv, Nk),
  // the keys with a finite offset. Null without: key_mask is (B, Nk), one row a batch element.
  const T* offset = nullptr;
  // Large heads, group by group (forward_impl): O holds the output rows of heads o0 .. o0 + the
  // group's size in T, dense (head by head, rows D apart), and each query's row is written into OUT
  // where it is last merged (merge_block, merge; a padded query's zeros by the gate).
  bool grouped = false;
  int64_t o0 = 0;

  // Head x's row of the key mask (null: every key real) and its index into n_real.
  int64_t mask_row(int64_t x) const { return offset ? (x / H) * Hkv + (x % H) / G : x / H; }
  const bool* keys_real(int64_t x) const { return key_mask ? key_mask + mask_row(x) * Nk : nullptr; }
  const T* key_offset(int64_t x) const { return offset ? offset + mask_row(x) * Nk : nullptr; }

  // One thread's buffers, sized for phase A on up to `rows` landmark rows (Kb, Vb: a block of
  // keys and values converted from half precision, else empty).
  struct Scratch {
    Buffer<T> S, mx, sum, G, Ke, Ve, Qb, Sb, Ob, lse, a, w, Kb, Vb;
    Buffer<bf16> Ha, Hl, Hb, Hv, Hs;  // bfloat16 products: an A operand, rows, VNNI B operands, pack_shared
    Buffer<Key> keys, block_keys;
    Buffer<int32_t> index;
    Buffer<int64_t> order;
    Scratch(const Forward& f, int64_t rows)
        : S(rows * kKeyBlock), mx(rows), sum(rows), G(kQueryBlock * padded_ld<T>(f.m)), Ke(f.topk * f.D), Ve(f.topk * f.D),
          Qb(padded_ld<T>(kQueryBlock) * f.D), Sb(padded_ld<T>(kQueryBlock) * std::max(f.topk, f.m)), Ob(kQueryBlock * f.D), lse(padded_ld<T>(kQueryBlock)),
          a(padded_ld<T>(kQueryBlock)), w(padded_ld<T>(kQueryBlock)), keys(rows * (f.topk + kKeyBlock + 2 * Vectorized<Key>::size())),
          block_keys(kKeyBlock), index(rows * (f.topk + kKeyBlock + 2 * Vectorized<Key>::size())), order(f.m),
          Kb(kHalf ? kKeyBlock * f.D : 0), Vb(kHalf ? kKeyBlock * f.D : 0) {
      if (f.bf16_path()) {
        const int64_t n = std::max({kKeyBlock, 2 * f.m, f.topk}) + 2;
        Ha.resize(std::max(rows, kQueryBlock) * std::max(n, f.D));
        Hl.resize(std::max(rows, 2 * f.m) * f.D);
        Hb.resize(n * f.D);
        Hv.resize((f.topk + 1) * f.D);
        if (f.by_head) Hs.resize(f.shared_size());
      }
    }
  };

  // Whether a head's keys take more than kPrefetchAbove bytes: rows read by index or first read
  // then are asked for ahead.
  bool ahead() const { return Nk * D * int64_t(sizeof(T)) > kPrefetchAbove; }

  // Head x's rows: element (t, d) of q at qx(x)[t * qr.st + d], and so on.
  const In* qx(int64_t x) const { return Q + qr.head(x / H, x % H); }
  const In* kx(int64_t x) const { return K + kr.head(x / H, (x % H) / G); }
  const In* vx(int64_t x) const { return Vv + vr.head(x / H, (x % H) / G); }
  T* ox(int64_t x) const { return grouped ? O + (x - o0) * Nq * D : O + outr.head(x / H, x % H); }
  int64_t ost() const { return grouped ? D : outr.st; }  // O's row stride
  In* outx(int64_t x) const { return OUT + outr.head(x / H, x % H); }

  // A: shared-expert values and the experts' keys of landmark rows r0 .. r0+nr of head x.
  void experts(int64_t x, int64_t r0, int64_t nr, Scratch& sc) const {
    const T ninf = -std::numeric_limits<T>::infinity();
    const int64_t kk = std::min(topk, n_real[mask_row(x)]);
    const T* Lx = L + (x * m + r0) * D;
    const In* Kx = kx(x);
    const In* Vx = vx(x);
    const bool* km = keys_real(x);
    const T* off = key_offset(x);
    const T inv_scale = T(1) / scale;
    T* acc = VS + (x * m + r0) * D;
    std::fill(acc, acc + nr * D, T(0));
    std::fill(sc.mx.begin(), sc.mx.begin() + nr, ninf);
    std::fill(sc.sum.begin(), sc.sum.begin() + nr, T(0));
    const int64_t cap = topk + kKeyBlock, stride = whole_vectors<Key>(cap) + Vectorized<Key>::size();
    std::vector<TopK<T>> best(nr);
    for (int64_t r = 0; r < nr; ++r) best[r] = {sc.keys.data() + r * stride, sc.index.data() + r * stride, kk, cap};
    T* S = sc.S.data();
    if constexpr (kBf16)
      if (bf16_path()) rows_to_bf16(Lx, nr, D, D, sc.Hl.data(), D);
    for (int64_t j0 = 0; j0 < Nk; j0 += kKeyBlock) {
      const int64_t nb = std::min(kKeyBlock, Nk - j0);
      int64_t lk = kr.st, lv = vr.st;
      bool done = false;  // (by bfloat16 products)
      if constexpr (kBf16)
        if ((done = bf16_path())) {
          vnni_from_columns(D, nb, [&](int64_t j) { return Kx + (j0 + j) * kr.st; }, sc.Hb.data());
          gemm_bf16(nr, nb, D, sc.Hl.data(), D, sc.Hb.data(), false, S, nb);
        }
      if (!done) {
        const T* Kb = rows_as(Kx + j0 * kr.st, nb, D, lk, sc.Kb.data());
        gemm<T>(false, true, nr, nb, D, Lx, D, Kb, lk, false, S, nb);
      }
      // This block's values and the next block's keys asked for ahead, a share with each row's
      // softmax, where the keys take more than kPrefetchAbove bytes: their first reads (the packing
      // for brgemm, from memory) waited on them (forward 2-3% faster at N = 4,096 and 16,384,
      // float32 and bfloat16, Zen 4).
      const int64_t nn = ahead() ? std::min(kKeyBlock, Nk - j0 - nb) : 0, nv = ahead() ? nb : 0;
      for (int64_t r = 0; r < nr; ++r) {
        for (int64_t j = r * nn / nr; j < (r + 1) * nn / nr; ++j) prefetch_row(Kx + (j0 + nb + j) * kr.st, D);
        for (int64_t j = r * nv / nr; j < (r + 1) * nv / nr; ++j) prefetch_row(Vx + (j0 + j) * vr.st, D);
        T* row = S + r * nb;
        if (off)  // A + offset / s0: the top-k by a group's mass, s0 A + offset in the softmax (-inf: no part)
          for (int64_t j = 0; j < nb; ++j) row[j] += off[j0 + j] * inv_scale;
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
      if constexpr (kBf16)
        if (done) {
          const int64_t nb2 = nb + nb % 2;
          rows_to_bf16(S, nr, nb, nb, sc.Ha.data(), nb2);
          vnni_from_rows(nb, D, [&](int64_t j) { return Vx + (j0 + j) * vr.st; }, sc.Hb.data());
          gemm_bf16(nr, D, nb2, sc.Ha.data(), nb2, sc.Hb.data(), true, acc, D);
        }
      if (!done) {
        const T* Vb = rows_as(Vx + j0 * vr.st, nb, D, lv, sc.Vb.data());
        gemm<T>(false, false, nr, D, nb, S, nb, Vb, lv, true, acc, D);
      }
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

  // B: gate, routes and the shared branch of queries t0 .. t0+nq of head x. G = Q L^T (nq x m) takes
  // the query rows in place and feeds the shared branch's product as it is: no transpose of a query
  // block or of G (computed as G^T = L Q^T for the queries as lanes, both were transposed for brgemm).
  // Each query's argmax, softmax and log-sum-exp run along its row of m gates, padded with -inf.
  void gate(int64_t x, int64_t t0, int64_t nq, Scratch& sc) const {
    using V = Vectorized<T>;
    const T ninf = -std::numeric_limits<T>::infinity();
    const bool* qm = query_mask ? query_mask + (x / H) * Nq : nullptr;
    const int64_t ld = padded_ld<T>(m), W = V::size();
    T* G = sc.G.data();
    [[maybe_unused]] const bf16* packed = nullptr;
    if constexpr (kBf16)
      if (bf16_path()) {  // G = Q L^T with the query rows read in place, the landmarks rounded
        packed = shared ? shared + x * shared_size() : sc.Hs.data();
        gemm_bf16(nq, m, D, qx(x) + t0 * qr.st, qr.st, packed, false, G, ld);
      }
    if (!bf16_path()) {
      int64_t lq = qr.st;
      const T* Qb = rows_as(qx(x) + t0 * qr.st, nq, D, lq, sc.Qb.data());
      gemm<T>(false, true, nq, m, D, Qb, lq, L + x * m * D, D, false, G, ld);
    }
    const V vls(lscale), vninf(ninf);
    bool by_lanes = false;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<T, float>)
      if ((by_lanes = s == 1 && ld <= kLanesUpTo)) {
        // W queries at a time as the lanes (their rows of G transposed in registers, and back): the
        // max, argmax, exponentials and sum run down the m gates with no horizontal reduction, where
        // a query by rows takes two (rows of 25 gates, N = 197: the gate was 9% of the forward).
        alignas(64) T col[kLanesUpTo * V::size()];
        const auto transpose_rows = [&](int64_t i0, bool back) {
          for (int64_t c0 = 0; c0 < ld; c0 += W) {
            V r[V::size()];
            MITA_UNROLL for (int w = 0; w < W; ++w) r[w] = V::loadu(back ? col + (c0 + w) * W : G + (i0 + w) * ld + c0);
            transpose_block(r);
            MITA_UNROLL for (int w = 0; w < W; ++w) r[w].store(back ? G + (i0 + w) * ld + c0 : col + (c0 + w) * W);
          }
        };
        for (int64_t i0 = 0; i0 < nq; i0 += W) {  // (rows past nq are scratch: G holds kQueryBlock rows)
          transpose_rows(i0, false);
          V vmax = vninf;
          for (int64_t j = 0; j < m; ++j) vmax = at::vec::maximum(vmax, V::loadu(col + j * W));
          V arg(T(-1));  // the first largest gate; none where the max is NaN, which routes to 0
          for (int64_t j = 0; j < m; ++j)
            arg = V::blendv(arg, V(T(j)), (V::loadu(col + j * W) == vmax) & (arg == V(T(-1))));
          V sum(T(0));
          for (int64_t j = 0; j < m; ++j) {  // the difference scaled, never above 0: see exp_sum
            const V p = vexp((V::loadu(col + j * W) - vmax) * vls);
            p.store(col + j * W);
            sum = sum + p;
          }
          const V inv = V(T(1)) / sum;
          for (int64_t j = 0; j < m; ++j) (V::loadu(col + j * W) * inv).store(col + j * W);
          for (int64_t j = m; j < ld; ++j) V(T(0)).store(col + j * W);
          (vmax * vls).store(sc.a.data() + i0);  // the largest logit
          sum.store(sc.w.data() + i0);
          T args[V::size()];
          arg.store(args);
          for (int64_t w = 0; w < W && i0 + w < nq; ++w) R[x * Nq + t0 + i0 + w] = args[w] < 0 ? 0 : int64_t(args[w]);
          transpose_rows(i0, true);
        }
      }
#endif
    // By rows, `n` queries at a time, each step over their rows in turn: a row's steps (max, its
    // reduction, argmax, exponentials, their sum, the scaling) are one chain whose latency bounded
    // the loop at rows of 49-64 gates; the chains of n rows overlap.
    const auto by_rows = [&](int64_t i0, auto rows) {
      constexpr int n = decltype(rows)::value;
      T* g[n];
      T gmax[n], tot[n];
      V vmax[n], sum[n];
      for (int r = 0; r < n; ++r) {
        g[r] = G + (i0 + r) * ld;
        std::fill(g[r] + m, g[r] + ld, ninf);  // whole vectors
        vmax[r] = vninf;
        sum[r] = V(T(0));
      }
      for (int64_t j = 0; j < ld; j += W)
        for (int r = 0; r < n; ++r) vmax[r] = at::vec::maximum(vmax[r], V::loadu(g[r] + j));
      for (int r = 0; r < n; ++r)
        gmax[r] = at::vec::vec_reduce_all<T>([](V& p, V& c) { return at::vec::maximum(p, c); }, vmax[r]);
      for (int r = 0; r < n; ++r) {
        int64_t* route = R + (x * Nq + t0 + i0 + r) * s;
        const T* row = g[r];
        if (s == 1) {  // the first largest gate (a NaN among them routes to 0)
          int64_t arg = 0;
          if (gmax[r] == gmax[r])
            // 64 gates a step, their hits in one mask: no exit taken per vector, mispredicted where the
            // maximum lies at random (forward 0.95-0.98 at N = 1,025 and 4,096-16,384, two runs, Zen 5)
            for (int64_t c0 = 0; c0 < ld; c0 += 64) {
              uint64_t hits = 0;
              for (int64_t j = c0; j < std::min(ld, c0 + 64); j += W)
                hits |= uint64_t(~(V::loadu(row + j) == V(gmax[r])).zero_mask() & ((1 << W) - 1)) << (j - c0);
              if (hits) {
                arg = c0 + __builtin_ctzll(hits);
                break;
              }
            }
          route[0] = arg;
        } else {  // the s largest gates, ties to the lower landmark
          int64_t* order = sc.order.data();
          std::iota(order, order + m, int64_t(0));
          std::partial_sort(order, order + s, order + m, [row](int64_t a, int64_t c) {
            return row[a] > row[c] || (row[a] == row[c] && a < c);
          });
          std::copy(order, order + s, route);
        }
      }
      for (int64_t j = 0; j < ld; j += W)
        for (int r = 0; r < n; ++r) {  // the difference scaled, never above 0: see exp_sum
          const V p = vexp((V::loadu(g[r] + j) - V(gmax[r])) * vls);
          p.store(g[r] + j);
          sum[r] = sum[r] + p;
        }
      for (int r = 0; r < n; ++r) tot[r] = at::vec::vec_reduce_all<T>([](V& p, V& c) { return p + c; }, sum[r]);
      for (int r = 0; r < n; ++r) {
        scale_row(g[r], m, T(1) / tot[r]);
        sc.a[i0 + r] = gmax[r] * lscale;  // the largest logit
        sc.w[i0 + r] = tot[r];
      }
    };
    if (!by_lanes) {
      int64_t i = 0;
      for (; i + 4 <= nq; i += 4) by_rows(i, std::integral_constant<int, 4>{});
      for (; i < nq; ++i) by_rows(i, std::integral_constant<int, 1>{});
    }
    if (qm)
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t t = t0 + i;
        if (qm[t]) continue;
        // A padded query: no routes of its own, zero output.
        for (int64_t j = 0; j < s; ++j) R[(x * Nq + t) * s + j] = j;
        std::fill(G + i * ld, G + i * ld + m, T(0));
        sc.a[i] = ninf;
        sc.w[i] = T(1);
        LT[x * Nq + t] = T(0);
        if (In* o = outx(x) + t * outr.st; grouped) std::fill(o, o + D, In(0));
      }
    log_add(sc.w.data(), sc.a.data(), LSE + x * Nq + t0, nq);  // lse = max + log(sum)
    if constexpr (kBf16)
      if (bf16_path() && !by_head) {
        // G V_S = [G | G] [V_hi; V_lo], G rounded to bfloat16 as the routed probabilities are, V_S
        // (float32, pooled) split in two halves (pack_shared): one product, as each brgemm call of
        // another shape costs about 2 us here (its kernel looked up, AMX's tiles configured). Small
        // heads keep the float32 product: through bfloat16 they took 1.02 of that at N = 197 and 1,025.
        const int64_t m2 = m + m % 2;
        bf16* A = sc.Ha.data();
        rows_to_bf16(G, nq, m, ld, A, 2 * m2);
        for (int64_t i = 0; i < nq; ++i) std::copy(A + i * 2 * m2, A + i * 2 * m2 + m2, A + i * 2 * m2 + m2);
        gemm_bf16(nq, D, 2 * m2, A, 2 * m2, packed + D * m, false, ox(x) + t0 * ost(), ost());
        return;
      }
    gemm<T>(false, false, nq, D, m, G, ld, VS + x * m * D, D, false, ox(x) + t0 * ost(), ost());
  }

  // Head x's operands of the gate and the shared branch, bfloat16 for their products: L^T as VNNI
  // (D x m), then (large heads) V_S split as hi + lo (split_bf16) in VNNI, [V_hi; V_lo] (2 m2 x D).
  int64_t shared_size() const { return D * m + 2 * (m + m % 2) * D; }
  void pack_shared(int64_t x, bf16* dst, Scratch& sc) const {
    if constexpr (kBf16) {
      const int64_t m2 = m + m % 2;
      bf16 *Lb = sc.Hl.data(), *Vh = Lb, *Vl = Lb + m * D;
      rows_to_bf16(L + x * m * D, m, D, D, Lb, D);
      vnni_from_columns(D, m, [&](int64_t j) { return Lb + j * D; }, dst);
      if (by_head) return;
      for (int64_t j = 0; j < m; ++j) split_bf16(VS + (x * m + j) * D, D, Vh + j * D, Vl + j * D);
      bf16* Bv = dst + D * m;
      vnni_from_rows(m, D, [&](int64_t j) { return static_cast<const bf16*>(Vh + j * D); }, Bv);
      vnni_from_rows(m, D, [&](int64_t j) { return static_cast<const bf16*>(Vl + j * D); }, Bv + m2 * D);
    }
  }

  // C: the routed expert e of head x attends its queries; merged into out (s = 1) or kept.
  void routed(int64_t x, int64_t e, Scratch& sc) const {
    const int64_t* st = start + x * (m + 1);
    const int64_t n_e = st[e + 1] - st[e];
    if (n_e == 0) return;
    const int64_t kk = std::min(topk, n_real[mask_row(x)]);
    const int64_t* keys = E + (x * m + e) * topk;
    const T* off = key_offset(x);
    const T inv_scale = T(1) / scale;
    const In* Kx = kx(x);
    const In* Vx = vx(x);
    T *Ke = sc.Ke.data(), *Ve = sc.Ve.data(), *Qb = sc.Qb.data(), *Sb = sc.Sb.data(), *Ob = sc.Ob.data();
    const int64_t* mem = members + x * Nq * s + st[e];
    // bfloat16 products for every expert of a large head: S = Q_e K_e^T from the bfloat16 rows as
    // they are (K_e^T packed once per expert), out = P V_e with P rounded to bfloat16 as SDPA's and
    // flash-attn's half-precision paths round it (V_e packed once): at N = 4,096 the output's error
    // against float64 is 0.9x SDPA bfloat16's (docs/performance.md). With P and G split as hi + lo
    // instead (float32-accurate), the bfloat16 forward at 4,096 took 0.99 of the one with these two
    // products in float32, rounded 0.86: the split costs the gain. A small head's small experts keep the float32
    // register tiles (forward 0.875 against 0.910 of float32 at N = 1,025, Zen 4).
    const bool small = n_e <= kQueryBlock && n_e * kk * D <= kSmallForward;
    const bool bf = bf16_path() && !(by_head && small);
    if (small && !bf) {  // a small expert: in registers, no gathers
      small_expert(x, mem, n_e, kk, keys, sc);
      merge_block(x, mem, n_e, sc);
      if (grouped) stream_fence();
      return;
    }
    if (!bf)
      for (int64_t i = 0; i < kk; ++i) {
        to_compute(Kx + keys[i] * kr.st, Ke + i * D, D);
        to_compute(Vx + keys[i] * vr.st, Ve + i * D, D);
      }
    const int64_t kk2 = kk + kk % 2;
    if constexpr (kBf16)
      if (bf) {
        vnni_from_columns(D, kk, [&](int64_t j) { return Kx + keys[j] * kr.st; }, sc.Hb.data());
        vnni_from_rows(kk, D, [&](int64_t j) { return Vx + keys[j] * vr.st; }, sc.Hv.data());
      }
    for (int64_t i0 = 0; i0 < n_e; i0 += kQueryBlock) {
      const int64_t nb = std::min(kQueryBlock, n_e - i0);
      const auto q = [&](int64_t i) { return qx(x) + (mem[i0 + i] / s) * qr.st; };
      // The shared output rows the merge reads (a group's scratch, rows by index), into L2 during the
      // products: forward 0.993 / 0.964 in float32, 0.972 / 0.916 in bfloat16 at N = 16,384, no change
      // at 4,096 (two runs, Zen 5).
      if (s == 1)
        for (int64_t i = 0; i < nb; ++i) prefetch_row<T, 2>(ox(x) + mem[i0 + i] * ost(), D);
      if constexpr (kBf16)
        if (bf) {
          for (int64_t i = 0; i < nb; ++i) std::copy(q(i), q(i) + D, sc.Ha.data() + i * D);
          gemm_bf16(nb, kk, D, sc.Ha.data(), D, sc.Hb.data(), false, Sb, kk);
        }
      if (!bf) {
        for (int64_t i = 0; i < nb; ++i) to_compute(q(i), Qb + i * D, D);
        gemm<T>(false, true, nb, kk, D, Qb, D, Ke, D, false, Sb, kk);
      }
      for (int64_t i = 0; i < nb; ++i) {
        T* row = Sb + i * kk;
        if (off)  // a kept key weighs as all its copies: s0 q.k + offset
          for (int64_t j = 0; j < kk; ++j) row[j] += off[keys[j]] * inv_scale;
        const auto [sm, rm] = exp_row(row, kk, scale);
        scale_row(row, kk, T(1) / sm);
        sc.w[i] = sm;
        sc.a[i] = rm;
      }
      log_add(sc.w.data(), sc.a.data(), sc.lse.data(), nb);
      bool pv = false;
      if constexpr (kBf16)
        if ((pv = bf)) {
          rows_to_bf16(Sb, nb, kk, kk, sc.Ha.data(), kk2);
          gemm_bf16(nb, D, kk2, sc.Ha.data(), kk2, sc.Hv.data(), false, Ob, D);
        }
      if (!pv) gemm<T>(false, false, nb, D, kk, Sb, kk, Ve, D, false, Ob, D);
      merge_block(x, mem + i0, nb, sc);
    }
    if (grouped) stream_fence();
  }

  // The routed softmax of a small expert's nb queries (slots mem) over its kk keys, into sc.Ob and
  // sc.lse: S^T = K_e Q^T (keys by index, queries packed as columns), a softmax down each column,
  // out = P V_e (values by index). The queries are the lanes of vectors V (with_lanes, products.h).
  void small_expert(int64_t x, const int64_t* mem, int64_t nb, int64_t kk, const int64_t* keys, Scratch& sc) const {
    with_lanes<T, In>(nb, [&](auto lanes) { small_expert_as<decltype(lanes)>(x, mem, nb, kk, keys, sc); });
  }
  template <typename V>
  void small_expert_as(int64_t x, const int64_t* mem, int64_t nb, int64_t kk, const int64_t* keys, Scratch& sc) const {
    const In* Kx = kx(x);
    const In* Vx = vx(x);
    T *Qt = sc.Qb.data(), *St = sc.Sb.data();
    const int64_t ld = lanes_ld<T, V>(nb);
    if (ahead()) {
      for (int64_t i = 0; i < nb; ++i) prefetch_row(qx(x) + (mem[i] / s) * qr.st, D);
      for (int64_t j = 0; j < kk; ++j) {
        prefetch_row(Kx + keys[j] * kr.st, D);
        prefetch_row(Vx + keys[j] * vr.st, D);
      }
    }
    // Half precision: the expert's keys and values converted once into Ke, Ve. Read in place, each
    // key element the first product broadcasts would be converted alone (measured 15-20% slower
    // forward at N = 1,024 and 4,096 in bfloat16 than float32, Zen 3).
    if constexpr (kHalf)
      if (!Kf)
        for (int64_t j = 0; j < kk; ++j) {
          to_compute(Kx + keys[j] * kr.st, sc.Ke.data() + j * D, D);
          to_compute(Vx + keys[j] * vr.st, sc.Ve.data() + j * D, D);
        }
    const auto krow = [&](int64_t j) {
      if constexpr (kHalf) return Kf ? Kf + keys[j] * D : static_cast<const T*>(sc.Ke.data() + j * D);
      else return Kx + keys[j] * kr.st;
    };
    const auto vrow = [&](int64_t j) {
      if constexpr (kHalf) return Vf ? Vf + keys[j] * D : static_cast<const T*>(sc.Ve.data() + j * D);
      else return Vx + keys[j] * vr.st;
    };
    rows_as_columns<T, V>(nb, D, ld, scale, [&](int64_t i) { return qx(x) + (mem[i] / s) * qr.st; }, Qt);
    small_gemm<T, V>(kk, ld, D, krow, 1, [&](int64_t d) { return Qt + d * ld; }, strided(St, ld));
    if (const T* off = key_offset(x))  // the scores are s0 q.k already: + offset, a kept key as all its copies
      for (int64_t j = 0; j < kk; ++j) {
        const V o(off[keys[j]]);
        for (int64_t i0 = 0; i0 < ld; i0 += V::size()) (V::loadu(St + j * ld + i0) + o).store(St + j * ld + i0);
      }
    if (s == 1 && ahead())  // the output rows merge_block updates
      for (int64_t i = 0; i < nb; ++i) prefetch_row(ox(x) + mem[i] * ost(), D);
    for (int64_t i0 = 0; i0 < ld; i0 += V::size()) {  // the queries are the lanes
      V mx(-std::numeric_limits<T>::infinity()), sum(T(0));
      for (int64_t j = 0; j < kk; ++j) mx = lanes_max(mx, V::loadu(St + j * ld + i0));
      for (int64_t j = 0; j < kk; ++j) {
        const V p = vexp(V::loadu(St + j * ld + i0) - mx);
        p.store(St + j * ld + i0);
        sum = sum + p;
      }
      const V inv = V(T(1)) / sum;
      for (int64_t j = 0; j < kk; ++j) (V::loadu(St + j * ld + i0) * inv).store(St + j * ld + i0);
      (mx + sum.log()).store(sc.lse.data() + i0);
    }
    small_gemm<T>(nb, D, kk, [&](int64_t i) { return St + i; }, ld, vrow, strided(sc.Ob.data(), D));
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
        T* o = ox(x) + t * ost();
        T* r = sc.Ob.data() + i * D;
        const T wi = sc.w[i];
        if (grouped) {  // this query's last write: into out, O not written back
          for (int64_t d = 0; d < D; ++d) r[d] = o[d] + wi * (r[d] - o[d]);
          stream_from_compute(r, outx(x) + t * outr.st, D);
        } else {
          for (int64_t d = 0; d < D; ++d) o[d] += wi * (r[d] - o[d]);
        }
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
      T* o = ox(xt / Nq) + (xt % Nq) * ost();
      for (int64_t d = 0; d < D; ++d) {
        T a = w[0] * o[d];
        for (int64_t j = 0; j < s; ++j) a += w[j + 1] * RO[(xt * s + j) * D + d];
        o[d] = a / ws;
      }
      if (grouped) from_compute(o, outx(xt / Nq) + (xt % Nq) * outr.st, D);
    }
  }

  void group(int64_t x) const {
    group_by_expert(R + x * Nq * s, query_mask ? query_mask + (x / H) * Nq : nullptr, Nq, s, m, start + x * (m + 1),
                    members + x * Nq * s);
  }

  void pool(int64_t x) const {
    if (bins) pool_head(qx(x), qr.st, m, D, bins, L + x * m * D);
  }

  // This call in float32 with every head's q, k, v rows read from q, k, v and its output rows
  // written to o (rows D apart), its other outputs where this call's are: run head by head, the
  // head's rows converted into q, k, v first and o rounded into OUT after.
  Forward<T, T> on_rows(const T* q, const T* k, const T* v, T* o) const {
    const Rows dense(D);
    Forward<T, T> g{H, Nq, D, Hkv, Nk, m, G, topk, s, scale, lscale, q, k, v, dense, dense, dense, dense, L, bins,
                    key_mask, query_mask, o, VS, LA, LT, LSE, RO, RL, o, E, R, start, members, n_real};
    g.offset = offset;
    return g;
  }

  // Part e of m of head x's q, k, v rows read into L2 ahead of its turn (read_ahead, products.h):
  // during the routed phase of the head before it (forward 0.91-0.96 / 0.97-0.98 of the time at
  // N = 197 / 1,025, Zen 4).
  void prefetch_head(int64_t x, int64_t e) const {
    read_ahead<In>({{qx(x), qr.st, Nq}, {kx(x), kr.st, Nk}, {vx(x), vr.st, Nk}}, D, e, m);
  }

  // Every phase of head x, in turn, with during(e) after each routed expert e.
  template <typename During>
  void head(int64_t x, Scratch& sc, const During& during) const {
    pool(x);
    experts(x, 0, m, sc);
    if (bf16_path()) pack_shared(x, sc.Hs.data(), sc);
    for (int64_t t0 = 0; t0 < Nq; t0 += kQueryBlock) gate(x, t0, std::min(kQueryBlock, Nq - t0), sc);
    group(x);
    for (int64_t e = 0; e < m; ++e) {
      routed(x, e, sc);
      during(e);
    }
    if (s > 1) merge(x * Nq, (x + 1) * Nq);
  }
};

// Heads per group of the large heads' gate and routed phases: the fewest that give every thread
// four or more query blocks and experts to take.
inline int64_t head_group(int64_t X, int64_t Nq, int64_t m, int64_t threads) {
  const int64_t items = std::max<int64_t>(1, std::min((Nq + kQueryBlock - 1) / kQueryBlock, m));
  return std::clamp<int64_t>((4 * threads + items - 1) / items, 1, X);
}

template <typename T, typename In>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& lm, Bins bins,
                  const bool* key_mask, const bool* query_mask, int64_t topk, int64_t s, double scale_,
                  double landmark_scale_, at::Tensor& out, at::Tensor& experts, at::Tensor& routes,
                  at::Tensor& v_shared, at::Tensor& lse_a, at::Tensor& lse_t, const T* offset) {
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Nk = k.size(2), m = lm.size(2), X = B * H;
  const auto opts = lm.options();  // T
  at::Tensor lse_shared = kept_empty({X, Nq}, opts);
  const int64_t threads = at::get_num_threads();
  // Small heads (q, k, v within about L2) run all their phases in one task, head by head.
  const bool by_head = (Nq + 2 * Nk) * D * int64_t(sizeof(T)) <= kSmallHead && X >= threads;
  constexpr bool half = Forward<T, In>::kHalf;
  // Large heads go group by group through the gate and the routed phase (below), a group's output
  // rows in scratch; small heads in half precision write a head's rows in scratch instead.
  const int64_t group = by_head ? 0 : head_group(X, Nq, m, threads);
  const at::Tensor out_t = by_head ? (half ? at::Tensor() : out) : kept_empty({group * Nq * D}, opts);
  at::Tensor count_t = kept_empty({X, m + 1}, opts.dtype(at::kLong));
  at::Tensor members_t = kept_empty({X, Nq * s}, opts.dtype(at::kLong));
  at::Tensor routed_out, routed_lse;  // s > 1: each (query, route) result, merged after
  if (s > 1) {
    routed_out = kept_empty({X, Nq * s, D}, opts);
    routed_lse = kept_empty({X, Nq * s}, opts);
  }
  Forward<T, In> f{H, Nq, D, Hkv, Nk, m, H / Hkv, topk, s, static_cast<T>(scale_), static_cast<T>(landmark_scale_),
                   q.data_ptr<In>(), k.data_ptr<In>(), v.data_ptr<In>(), Rows(q), Rows(k), Rows(v), Rows(out),
                   lm.data_ptr<T>(), bins, key_mask, query_mask,
                   out_t.defined() ? out_t.data_ptr<T>() : nullptr, v_shared.data_ptr<T>(), lse_a.data_ptr<T>(),
                   lse_t.data_ptr<T>(),
                   lse_shared.data_ptr<T>(), s > 1 ? routed_out.data_ptr<T>() : nullptr,
                   s > 1 ? routed_lse.data_ptr<T>() : nullptr, out.data_ptr<In>(), experts.data_ptr<int64_t>(),
                   routes.data_ptr<int64_t>(), count_t.data_ptr<int64_t>(), members_t.data_ptr<int64_t>(),
                   std::vector<int64_t>(offset ? B * Hkv : B, Nk)};
  f.products = Forward<T, In>::kBf16 && D % 2 == 0 && products_allowed();
  f.offset = offset;
  if (key_mask)  // the real keys of each mask row (a batch element, or a kv head with merged duplicates)
    for (size_t r = 0; r < f.n_real.size(); ++r) f.n_real[r] = std::count(key_mask + r * Nk, key_mask + (r + 1) * Nk, true);

  if (by_head) {
    guided_runs(X, [&](const auto& take) {
      const SingleThreadedBlas blas;
      // The head this thread runs next read ahead during the current one's routed phase.
      const auto ahead = [&f](int64_t after) {
        return [&f, after](int64_t e) {
          if (after >= 0) f.prefetch_head(after, e);
        };
      };
      using Heads = Taken<std::decay_t<decltype(take)>>;
      if constexpr (Forward<T, In>::kBf16)
        if (f.bf16_path()) {
          // bfloat16 products: every phase reads a head's q, k, v rows in place as bfloat16; its
          // output rows are finished in float32 scratch, then rounded into out.
          const Bf16Products release;
          // The key and value rows converted once for the small routed experts where those would
          // convert three times as many or more, expert by expert (m k rows): bfloat16 forward 0.966 /
          // 0.907 at N = 197, m = k = 25 / 49 (3.2 / 12 times; one thread, copy 1.001-1.003); 1.008 at
          // N = 1,025, m = k = 49 (2.3 times), 1.025 at N = 577, m = k = 25 (1.1 times; Zen 4).
          const bool once = m * topk >= 3 * Nk;
          Buffer<T> ho(Nq * D), hk(once ? Nk * D : 0), hv(hk.size());
          Forward<T, In> g = f;
          g.O = ho.data();
          g.outr = Rows(D);
          g.by_head = true;
          if (once) {
            g.Kf = hk.data();
            g.Vf = hv.data();
          }
          typename Forward<T, In>::Scratch sc(g, m);
          for (Heads heads(take); heads.next();) {
            const int64_t x = heads.x();
            if (once) {
              int64_t lk = f.kr.st, lv = f.vr.st;  // (rows_as sets them to D)
              rows_as(f.kx(x), Nk, D, lk, hk.data());
              rows_as(f.vx(x), Nk, D, lv, hv.data());
            }
            g.head(x, sc, ahead(heads.after()));
            In* o = f.outx(x);
            for (int64_t t = 0; t < Nq; ++t) from_compute(ho.data() + t * D, o + t * f.outr.st, D);
          }
          return;
        }
      if constexpr (half) {
        // Half precision: a small head's q, k, v rows converted once, in cache, then read in place
        // as float32 rows by every phase (converted per block, each row was converted twice or more:
        // the forward took 1.07x float32's time at N = 197, Zen 3); its output rows in cache too.
        Buffer<T> hq(Nq * D), hk(Nk * D), hv(Nk * D), ho(Nq * D);
        const Forward<T, T> g = f.on_rows(hq.data(), hk.data(), hv.data(), ho.data());
        typename Forward<T, T>::Scratch sc(g, m);
        for (Heads heads(take); heads.next();) {
          const int64_t x = heads.x();
          int64_t lq = f.qr.st, lk = f.kr.st, lv = f.vr.st;  // (rows_as sets them to D)
          rows_as(f.qx(x), Nq, D, lq, hq.data());
          rows_as(f.kx(x), Nk, D, lk, hk.data());
          rows_as(f.vx(x), Nk, D, lv, hv.data());
          g.head(x, sc, ahead(heads.after()));
          In* o = f.outx(x);
          for (int64_t t = 0; t < Nq; ++t) from_compute(ho.data() + t * D, o + t * f.outr.st, D);
        }
      } else {
        typename Forward<T, In>::Scratch sc(f, m);
        for (Heads heads(take); heads.next();) f.head(heads.x(), sc, ahead(heads.after()));
      }
    });
    return;
  }
  // Large heads: each phase split across the threads (landmark rows, query blocks, experts), the
  // gate's and the routed phase's items in guided runs.
  const auto guided_for = [&](int64_t n, const auto& body) {
    guided_runs(n, [&](const auto& take) {
      const SingleThreadedBlas blas;
      [[maybe_unused]] const std::conditional_t<Forward<T, In>::kBf16, Bf16Products, bool> release{};
      typename Forward<T, In>::Scratch sc(f, 1);
      for (int64_t begin = 0, end = 0; take(begin, end);) body(begin, end, sc);
    });
  };
  at::Tensor shared_t;  // bfloat16 products: each head's gate and shared-branch operands, packed once
  if (f.bf16_path()) {
    shared_t = kept_empty({X, f.shared_size()}, opts.dtype(at::kBFloat16));
    f.shared = reinterpret_cast<bf16*>(shared_t.data_ptr());
  }
  if (bins) at::parallel_for(0, X, 1, [&](int64_t begin, int64_t end) {
      for (int64_t x = begin; x < end; ++x) f.pool(x);
    });
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>((threads + X - 1) / X, m / 16));
  const int64_t rows = (m + chunks - 1) / chunks;
  at::parallel_for(0, X * chunks, 1, [&](int64_t begin, int64_t end) {
    const SingleThreadedBlas blas;
    [[maybe_unused]] const std::conditional_t<Forward<T, In>::kBf16, Bf16Products, bool> release{};
    typename Forward<T, In>::Scratch sc(f, rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t x = item / chunks, r0 = (item % chunks) * rows, nr = std::min(rows, m - r0);
      if (nr > 0) f.experts(x, r0, nr, sc);
      if (f.shared && chunks == 1) f.pack_shared(x, f.shared + x * f.shared_size(), sc);
    }
  });
  if (f.shared && chunks > 1)
    at::parallel_for(0, X, 1, [&](int64_t begin, int64_t end) {
      typename Forward<T, In>::Scratch sc(f, 1);
      for (int64_t x = begin; x < end; ++x) f.pack_shared(x, f.shared + x * f.shared_size(), sc);
    });
  // The gate, routing and routed experts group by group of heads: the shared branch's output rows
  // the merge reads back are a group's, in cache, and half precision keeps no float32 copy of out.
  const int64_t qblocks = (Nq + kQueryBlock - 1) / kQueryBlock;
  f.grouped = true;
  for (int64_t x0 = 0; x0 < X; x0 += group) {
    const int64_t nx = std::min(group, X - x0);
    f.o0 = x0;
    guided_for(nx * qblocks, [&](int64_t begin, int64_t end, typename Forward<T, In>::Scratch& sc) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t t0 = item / nx * kQueryBlock;
        f.gate(x0 + item % nx, t0, std::min(kQueryBlock, Nq - t0), sc);
      }
    });
    at::parallel_for(x0, x0 + nx, 1, [&](int64_t begin, int64_t end) {
      for (int64_t x = begin; x < end; ++x) f.group(x);
    });
    guided_for(nx * m, [&](int64_t begin, int64_t end, typename Forward<T, In>::Scratch& sc) {
      for (int64_t item = begin; item < end; ++item) f.routed(x0 + item / m, item % m, sc);
    });
    if (s > 1)
      at::parallel_for(x0 * Nq, (x0 + nx) * Nq, 256, [&](int64_t begin, int64_t end) { f.merge(begin, end); });
  }
}

}  // namespace
