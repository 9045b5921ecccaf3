// The backward of the joint softmax, the shared values and the landmark pooling, per head.
// Part of the fused MiTA CPU kernel (fused_cpu.cpp, one translation unit; see README.md here).

#pragma once

#include "forward.h"

namespace {

// Backward of the joint softmax of step 6 and of V~ = softmax(s0 L K^T) V, per head x (one
// task per head: dq, dlandmarks and the head's dk, dv rows have one writer). p are the joint
// probabilities exp(logit - lse_t); with delta = <dout, out> per query, d logit = p (dp - delta).
// Order: the shared expert (dq written), the shared values (dk, dv written), the routed experts
// (added in; small ones in register tiles, as the forward's). dout, q, k, v, out and the gradients
// of q, k, v are of type In, computed in T (float for bfloat16 and float16: see Compute in vec.h): a
// head's gradients are then accumulated in float32 scratch and rounded into dq, dk, dv at its end.
template <typename T, typename In>
void backward_impl(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& lm, const bool* key_mask, const bool* query_mask, const at::Tensor& experts,
                   const at::Tensor& routes, const at::Tensor& out, const at::Tensor& v_shared,
                   const at::Tensor& lse_a, const at::Tensor& lse_t, double scale_, double landmark_scale_,
                   Bins bins, const at::Tensor* dl_extra, const T* offset, at::Tensor& dq, at::Tensor& dk,
                   at::Tensor& dv, at::Tensor& dl) {
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Nk = k.size(2), m = lm.size(2), G = H / Hkv, X = B * H;
  const int64_t topk = experts.size(3), s = routes.size(3);
  const T scale = static_cast<T>(scale_), lscale = static_cast<T>(landmark_scale_);
  constexpr bool half = !std::is_same_v<T, In>;
  const In *dO = dout.data_ptr<In>(), *Q = q.data_ptr<In>(), *K = k.data_ptr<In>(), *Vv = v.data_ptr<In>();
  const In* O = out.data_ptr<In>();
  const T *L = lm.data_ptr<T>(), *VS = v_shared.data_ptr<T>();
  const T *LA = lse_a.data_ptr<T>(), *LT = lse_t.data_ptr<T>();
  const int64_t *E = experts.data_ptr<int64_t>(), *R = routes.data_ptr<int64_t>();
  In *dQ = dq.data_ptr<In>(), *dK = dk.data_ptr<In>(), *dV = dv.data_ptr<In>();
  T* dL = dl.data_ptr<T>();
  const Rows qr(q), kr(k), vr(v), outr(out), dor(dout);  // dq, dk, dv are contiguous
  const int64_t qs = qr.st, ks = kr.st, vs = vr.st, os = outr.st, dos = dor.st;

  // Heads whose q, k, v fit about L2 (the forward's head-by-head ones): converted once in half precision
  // (bfloat16 / float32 backward 1.07 at N = 197 on Zen 3 with the rows converted block by block).
  const bool small = (Nq + 2 * Nk) * D * int64_t(sizeof(T)) <= kSmallHead;
  // bfloat16 products (as the forward's, products.h) for every product of a large head: the score
  // products from bfloat16 rows read in place and the landmarks the forward rounded (Q L^T, K L^T,
  // Q_e K_e^T, dO V_e^T), the others with their float32 operands rounded to bfloat16 (P, dS, v~ and
  // its gradient), as PyTorch's CPU flash attention rounds P and dS; sums and softmax in float32.
  constexpr bool bf = kBf16Products && std::is_same_v<In, bf16>;
  const bool use_bf = bf && !small && D % 2 == 0 && products_allowed();
  guided_runs(X, [&](const auto& take) {  // heads in guided runs (common.h)
    const SingleThreadedBlas blas;
    [[maybe_unused]] const std::conditional_t<bf, Bf16Products, bool> release{};
    // bfloat16 products: rows rounded (Lb), B operands as VNNI (L^T and L, v~^T, dv~^T and dv~; an
    // expert's K_e^T, V_e^T and K_e; a block's rows), gathered query and dout rows, A operands
    // rounded as rows (Ha) or transposed (At).
    const int64_t nbuf = std::max({padded_ld<T>(kQueryBlock), kKeyBlock, topk}), wide = std::max(m, topk) + 1;
    const auto bfn = [&](int64_t n) { return use_bf ? n : 0; };
    Buffer<bf16> Lb(bfn(m * D)), Lp(bfn(m * D)), Lr(bfn((m + 1) * D)), VSp(bfn(m * D)), dvsT(bfn(m * D)),
        dvsR(bfn((m + 1) * D)), Qh(bfn(kQueryBlock * D)), dOh(Qh.size()), Kp(bfn(topk * D)), Vp(Kp.size()),
        Kr(bfn((topk + 1) * D)), Ha(bfn(std::max(kQueryBlock, kKeyBlock) * wide)),
        At(bfn(wide * (std::max(kQueryBlock, kKeyBlock) + 1))), Bq(bfn((std::max(kQueryBlock, kKeyBlock) + 1) * D));
    [[maybe_unused]] const int64_t m2 = m + m % 2;
    Buffer<T> delta(Nq), dvs(m * D), rowdot(padded_ld<T>(m)), la(rowdot.size()), P(nbuf * std::max(padded_ld<T>(m), topk)), dP(nbuf * std::max(padded_ld<T>(m), topk));
    Buffer<T> Qb(padded_ld<T>(kQueryBlock) * D), dOb(padded_ld<T>(kQueryBlock) * D), dQb(kQueryBlock * D), Ke(topk * D), Ve(topk * D),
        dKe(topk * D), dVe(topk * D);
    // Half precision: a key block converted, and the head's gradients in T until rounded at its end.
    Buffer<T> Kb(half ? kKeyBlock * D : 0), Vb(half ? kKeyBlock * D : 0), dQf(half ? Nq * D : 0),
        dKf(half ? Nk * D : 0), dVf(half ? Nk * D : 0);
    Buffer<int64_t> start(m + 1), members(Nq * s);
    // Half precision, small heads: the head's q, dout, out, k, v rows in float32.
    Buffer<T> hq(half && small ? Nq * D : 0), hdo(hq.size()), ho(hq.size()), hk(half && small ? Nk * D : 0),
        hv(hk.size());
    for (Taken<std::decay_t<decltype(take)>> heads(take); heads.next();) {
      const int64_t x = heads.x(), after = heads.after();
      const int64_t b = x / H;
      const bool* qm = query_mask ? query_mask + b * Nq : nullptr;
      const int64_t h = x % H, hkv = h / G;
      // Merged duplicates: the kv head's key offsets, and its row of the (B, Hkv, Nk) key mask.
      const T* off = offset ? offset + (b * Hkv + hkv) * Nk : nullptr;
      const bool* km = key_mask ? key_mask + (offset ? b * Hkv + hkv : b) * Nk : nullptr;
      const int64_t kk = key_mask ? std::min<int64_t>(topk, std::count(km, km + Nk, true)) : topk;
      const T inv_scale = T(1) / scale;
      // Part e of m of the q, dout, out, k, v rows of the head this thread does next read into L2
      // ahead (read_ahead, products.h).
      const auto read_next = [&, b1 = after / H, h1 = after % H](int64_t e) {
        if (after >= 0)
          read_ahead<In>({{Q + qr.head(b1, h1), qs, Nq}, {dO + dor.head(b1, h1), dos, Nq}, {O + outr.head(b1, h1), os, Nq},
                          {K + kr.head(b1, h1 / G), ks, Nk}, {Vv + vr.head(b1, h1 / G), vs, Nk}},
                         D, e, m);
      };
      // The head's rows: read in place, or (half precision, a small head) converted once into
      // float32 scratch first, as the forward's on_rows does; the body below reads either.
      const auto head = [&](const auto* Qx, const auto* dOx, const auto* Ox, const auto* Kx, const auto* Vx,
                            int64_t qs, int64_t dos, int64_t os, int64_t ks, int64_t vs) {
        constexpr bool conv = !std::is_same_v<std::decay_t<decltype(*Kx)>, T>;  // rows still to convert
        const T *Lx = L + x * m * D, *VSx = VS + x * m * D, *LTx = LT + x * Nq;
        // The head's gradients: written in place, or (half precision) in scratch, rounded at its end.
        const auto grad = [](auto* rows, Buffer<T>& scratch) -> T* {
          if constexpr (std::is_same_v<decltype(rows), T*>) return rows;
          else return scratch.data();
        };
        T *dQx = grad(dQ + x * Nq * D, dQf), *dKx = grad(dK + x * Nk * D, dKf), *dVx = grad(dV + x * Nk * D, dVf);
        T* dLx = dL + x * m * D;
        for (int64_t t = 0; t < Nq; ++t) delta[t] = (qm && !qm[t]) ? T(0) : row_dot<T>(dOx + t * dos, Ox + t * os, D);
        std::fill(dvs.begin(), dvs.end(), T(0));

        // Shared expert: logits ls * q.q~, values v~, as the forward's gate: P = Q L^T and dP = dO V~^T
        // (nq x m, a row per query) take the query and dout rows in place and give dq = dP L as they
        // are; only the sums over queries (dL, dv~) read P and dP transposed.
        using V = Vectorized<T>;
        const int64_t ldm = padded_ld<T>(m);
        const V vls(lscale), vs0(scale);
        // Rows of P and dP (n rows, ldm apart) from their logits: p <- prob(p, a, lse), dp <- a p (dp - c),
        // lse(i, e) and c(i, e) the vectors of row i at column e; padded rows (real(i) false) zero.
        // Whole vectors: a row's padding is never read.
        const auto logit_grads = [&](T* P0, T* dP0, int64_t n, const V& a, const auto& real, const auto& lse,
                                     const auto& c) {
          for (int64_t i = 0; i < n; ++i) {
            T *p = P0 + i * ldm, *dp = dP0 + i * ldm;
            if (!real(i)) {
              std::fill(p, p + m, T(0));
              std::fill(dp, dp + m, T(0));
              continue;
            }
            for (int64_t e = 0; e < ldm; e += V::size()) {
              const V pv = prob(V::loadu(p + e), a, lse(i, e));
              pv.store(p + e);
              (a * pv * (V::loadu(dp + e) - c(i, e))).store(dp + e);
            }
          }
        };
        // (`if constexpr (bf)` first, apart: with the lambda's own `conv` in one condition with it, the
        // condition stayed dependent and clang checked these calls for doubles, an error.)
        // m rows of D floats rounded into Lb, as VNNI of their transpose (cols) and of themselves (rows).
        [[maybe_unused]] const auto pack = [&](const T* rows, bf16* cols, bf16* as_rows) {
          if constexpr (bf) {
            const auto row = [&](int64_t i) { return static_cast<const bf16*>(Lb.data() + i * D); };
            rows_to_bf16(rows, m, D, D, Lb.data(), D);
            if (cols) vnni_from_columns(D, m, row, cols);
            if (as_rows) vnni_from_rows(m, D, row, as_rows);
          }
        };
        if constexpr (bf) {
          if constexpr (conv)
            if (use_bf) {
              pack(Lx, Lp.data(), Lr.data());
              pack(VSx, VSp.data(), nullptr);
            }
        }
        for (int64_t t0 = 0; t0 < Nq; t0 += kQueryBlock) {
          const int64_t nq = std::min(kQueryBlock, Nq - t0);
          T *Pq = P.data(), *dPq = dP.data();
          const auto grads = [&] {
            logit_grads(
                Pq, dPq, nq, vls, [&](int64_t i) { return !qm || qm[t0 + i]; },
                [&](int64_t i, int64_t) { return V(LTx[t0 + i]); }, [&](int64_t i, int64_t) { return V(delta[t0 + i]); });
          };
          bool done = false;  // (by bfloat16 products)
          if constexpr (bf) {
            if constexpr (conv)
              if ((done = use_bf)) {
                const bf16 *Qr = Qx + t0 * qs, *dOr = dOx + t0 * dos;
                const int64_t nq2 = nq + nq % 2;
                gemm_bf16(nq, m, D, Qr, qs, Lp.data(), false, Pq, ldm);
                gemm_bf16(nq, m, D, dOr, dos, VSp.data(), false, dPq, ldm);
                grads();
                rows_to_bf16(dPq, nq, m, ldm, Ha.data(), m2);
                gemm_bf16(nq, D, m2, Ha.data(), m2, Lr.data(), false, dQx + t0 * D, D);
                columns_to_bf16(dPq, nq, m, ldm, At.data(), nq2);
                vnni_from_rows(nq, D, [&](int64_t i) { return Qr + i * qs; }, Bq.data());
                gemm_bf16(m, D, nq2, At.data(), nq2, Bq.data(), true, dLx, D);
                columns_to_bf16(Pq, nq, m, ldm, At.data(), nq2);
                vnni_from_rows(nq, D, [&](int64_t i) { return dOr + i * dos; }, Bq.data());
                gemm_bf16(m, D, nq2, At.data(), nq2, Bq.data(), true, dvs.data(), D);
              }
          }
          if (done) continue;
          int64_t lq = qs, ldo = dos;
          const T* Qt0 = rows_as(Qx + t0 * qs, nq, D, lq, Qb.data());
          const T* dOt0 = rows_as(dOx + t0 * dos, nq, D, ldo, dOb.data());
          gemm<T>(false, true, nq, m, D, Qt0, lq, Lx, D, false, Pq, ldm);
          gemm<T>(false, true, nq, m, D, dOt0, ldo, VSx, D, false, dPq, ldm);
          grads();
          gemm<T>(false, false, nq, D, m, dPq, ldm, Lx, D, false, dQx + t0 * D, D);
          gemm<T>(true, false, m, D, nq, dPq, ldm, Qt0, lq, true, dLx, D);
          gemm<T>(true, false, m, D, nq, Pq, ldm, dOt0, ldo, true, dvs.data(), D);
        }

        // Shared values v~ = softmax(s0 A) V, by key blocks: P_A recomputed from its log-sum-exp, as
        // P = K L^T and dP = V dv~^T (nb x m, a row per key, the landmarks as lanes), so that dv = P dv~
        // and dk = dP L take them as they are; only dL += dP^T K reads one transposed. It covers
        // every key, so it writes the head's dk and dv rows first (no zero-fill of them).
        for (int64_t i = 0; i < m; ++i) rowdot[i] = row_dot<T>(dvs.data() + i * D, VSx + i * D, D);
        std::copy(LA + x * m, LA + (x + 1) * m, la.begin());  // (both padded to whole vectors)
        if constexpr (bf) {
          if constexpr (conv)
            if (use_bf) pack(dvs.data(), dvsT.data(), dvsR.data());
        }
        for (int64_t j0 = 0; j0 < Nk; j0 += kKeyBlock) {
          const int64_t nb = std::min(kKeyBlock, Nk - j0);
          T *Pk = P.data(), *dPk = dP.data();
          const auto offset_logits = [&] {
            if (off)  // as the forward's A + offset / s0 (padded keys and copies are zeroed below)
              for (int64_t j = 0; j < nb; ++j) {
                const V o(off[j0 + j] * inv_scale);
                for (int64_t e = 0; e < ldm; e += V::size()) (V::loadu(Pk + j * ldm + e) + o).store(Pk + j * ldm + e);
              }
          };
          const auto grads = [&] {
            logit_grads(
                Pk, dPk, nb, vs0, [&](int64_t j) { return !km || km[j0 + j]; },
                [&](int64_t, int64_t e) { return V::loadu(la.data() + e); },
                [&](int64_t, int64_t e) { return V::loadu(rowdot.data() + e); });
          };
          bool done = false;  // (by bfloat16 products)
          if constexpr (bf) {
            if constexpr (conv)
              if ((done = use_bf)) {
                const bf16 *Kr0 = Kx + j0 * ks, *Vr0 = Vx + j0 * vs;
                const int64_t nb2 = nb + nb % 2;
                gemm_bf16(nb, m, D, Kr0, ks, Lp.data(), false, Pk, ldm);
                offset_logits();
                gemm_bf16(nb, m, D, Vr0, vs, dvsT.data(), false, dPk, ldm);
                grads();
                rows_to_bf16(Pk, nb, m, ldm, Ha.data(), m2);
                gemm_bf16(nb, D, m2, Ha.data(), m2, dvsR.data(), false, dVx + j0 * D, D);
                rows_to_bf16(dPk, nb, m, ldm, Ha.data(), m2);
                gemm_bf16(nb, D, m2, Ha.data(), m2, Lr.data(), false, dKx + j0 * D, D);
                columns_to_bf16(dPk, nb, m, ldm, At.data(), nb2);
                vnni_from_rows(nb, D, [&](int64_t j) { return Kr0 + j * ks; }, Bq.data());
                gemm_bf16(m, D, nb2, At.data(), nb2, Bq.data(), true, dLx, D);
              }
          }
          if (done) continue;
          int64_t lk = ks, lv = vs;
          const T* Kt0 = rows_as(Kx + j0 * ks, nb, D, lk, Kb.data());
          const T* Vt0 = rows_as(Vx + j0 * vs, nb, D, lv, Vb.data());
          gemm<T>(false, true, nb, m, D, Kt0, lk, Lx, D, false, Pk, ldm);
          offset_logits();
          gemm<T>(false, true, nb, m, D, Vt0, lv, dvs.data(), D, false, dPk, ldm);
          grads();
          gemm<T>(false, false, nb, D, m, Pk, ldm, dvs.data(), D, false, dVx + j0 * D, D);
          gemm<T>(false, false, nb, D, m, dPk, ldm, Lx, D, false, dKx + j0 * D, D);
          gemm<T>(true, false, m, D, nb, dPk, ldm, Kt0, lk, true, dLx, D);
        }

        // Routed experts: queries grouped by expert, as in the forward (members hold t * s + j).
        group_by_expert(R + x * Nq * s, qm, Nq, s, m, start.data(), members.data());
        for (int64_t e = 0; e < m; ++e) {
          read_next(e);
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
          // the same with BLAS-shaped buffers, tried first, measured no gain). The queries are the
          // lanes of vectors V (with_lanes, products.h).
          const auto small_expert = [&](auto lanes) {
            using V = decltype(lanes);
            const int64_t ld = lanes_ld<T, V>(n_e);
            T *Qt = Qb.data(), *dOt = dOb.data(), *Pt = P.data(), *dPt = dP.data();
            const auto qrow = [&](int64_t i) { return Qx + (mem[i] / s) * qs; };
            const auto dorow = [&](int64_t i) { return dOx + (mem[i] / s) * dos; };
            if constexpr (conv)  // keys and values converted once, as in the forward's small experts
              for (int64_t j = 0; j < kk; ++j) {
                to_compute(Kx + keys[j] * ks, Ke.data() + j * D, D);
                to_compute(Vx + keys[j] * vs, Ve.data() + j * D, D);
              }
            const auto krow = [&](int64_t j) {
              if constexpr (conv) return static_cast<const T*>(Ke.data() + j * D);
              else return Kx + keys[j] * ks;
            };
            const auto vrow = [&](int64_t j) {
              if constexpr (conv) return static_cast<const T*>(Ve.data() + j * D);
              else return Vx + keys[j] * vs;
            };
            rows_as_columns<T, V>(n_e, D, ld, T(1), qrow, Qt);
            rows_as_columns<T, V>(n_e, D, ld, T(1), dorow, dOt);
            small_gemm<T, V>(kk, ld, D, krow, 1, [&](int64_t d) { return Qt + d * ld; }, strided(Pt, ld));
            small_gemm<T, V>(kk, ld, D, vrow, 1, [&](int64_t d) { return dOt + d * ld; }, strided(dPt, ld));
            if (off)  // as the forward's routed logits: s0 q.k + offset
              for (int64_t j = 0; j < kk; ++j) {
                const V o(off[keys[j]] * inv_scale);
                for (int64_t i0 = 0; i0 < ld; i0 += V::size())
                  (V::loadu(Pt + j * ld + i0) + o).store(Pt + j * ld + i0);
              }
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
            // The gradients added straight into the head's rows of the expert's queries and keys (distinct
            // within an expert), as add_dq and add_dkv would after the products.
            small_gemm<T>(n_e, D, kk, [&](int64_t i) { return dPt + i; }, ld, krow,
                          [&](int64_t i) { return dQx + (mem[i] / s) * D; }, true);
            small_gemm<T>(kk, D, n_e, [&](int64_t j) { return dPt + j * ld; }, 1, qrow,
                          [&](int64_t j) { return dKx + keys[j] * D; }, true);
            small_gemm<T>(kk, D, n_e, [&](int64_t j) { return Pt + j * ld; }, 1, dorow,
                          [&](int64_t j) { return dVx + keys[j] * D; }, true);
          };
          if (n_e <= kQueryBlock && n_e * kk * D <= kSmallBackward) {
            with_lanes<T, std::decay_t<decltype(*Kx)>>(n_e, small_expert);
            continue;
          }
          bool done = false;  // (by bfloat16 products: K_e^T, V_e^T and K_e packed, the block's rows gathered)
          [[maybe_unused]] const int64_t kk2 = kk + kk % 2;
          if constexpr (bf) {
            if constexpr (conv)
              if ((done = use_bf)) {
                const auto krow = [&](int64_t j) { return Kx + keys[j] * ks; };
                vnni_from_columns(D, kk, krow, Kp.data());
                vnni_from_columns(D, kk, [&](int64_t j) { return Vx + keys[j] * vs; }, Vp.data());
                vnni_from_rows(kk, D, krow, Kr.data());
              }
          }
          if (!done)
            for (int64_t i = 0; i < kk; ++i) {
              to_compute(Kx + keys[i] * ks, Ke.data() + i * D, D);
              to_compute(Vx + keys[i] * vs, Ve.data() + i * D, D);
            }
          std::fill(dKe.begin(), dKe.end(), T(0));
          std::fill(dVe.begin(), dVe.end(), T(0));
          for (int64_t i0 = 0; i0 < n_e; i0 += kQueryBlock) {
            const int64_t nb = std::min(kQueryBlock, n_e - i0);
            if constexpr (bf) {
              if constexpr (conv)
                if (done) {
                  for (int64_t i = 0; i < nb; ++i) {
                    const int64_t t = mem[i0 + i] / s;
                    std::copy(Qx + t * qs, Qx + t * qs + D, Qh.data() + i * D);
                    std::copy(dOx + t * dos, dOx + t * dos + D, dOh.data() + i * D);
                  }
                  gemm_bf16(nb, kk, D, Qh.data(), D, Kp.data(), false, P.data(), kk);
                  gemm_bf16(nb, kk, D, dOh.data(), D, Vp.data(), false, dP.data(), kk);
                }
            }
            if (!done) {
              for (int64_t i = 0; i < nb; ++i) {
                const int64_t t = mem[i0 + i] / s;
                to_compute(Qx + t * qs, Qb.data() + i * D, D);
                to_compute(dOx + t * dos, dOb.data() + i * D, D);
              }
              gemm<T>(false, true, nb, kk, D, Qb.data(), D, Ke.data(), D, false, P.data(), kk);
              gemm<T>(false, true, nb, kk, D, dOb.data(), D, Ve.data(), D, false, dP.data(), kk);
            }
            for (int64_t i = 0; i < nb; ++i) {
              T *p = P.data() + i * kk, *dp = dP.data() + i * kk;
              const int64_t t = mem[i0 + i] / s;
              if (off)
                for (int64_t j = 0; j < kk; ++j) p[j] += off[keys[j]] * inv_scale;
              probs(p, kk, scale, LTx[t]);
              for (int64_t j = 0; j < kk; ++j) dp[j] = scale * p[j] * (dp[j] - delta[t]);
            }
            if constexpr (bf) {
              if constexpr (conv)
                if (done) {
                  const int64_t nb2 = nb + nb % 2;
                  rows_to_bf16(dP.data(), nb, kk, kk, Ha.data(), kk2);
                  gemm_bf16(nb, D, kk2, Ha.data(), kk2, Kr.data(), false, dQb.data(), D);
                  add_dq(mem + i0, nb);
                  columns_to_bf16(dP.data(), nb, kk, kk, At.data(), nb2);
                  vnni_from_rows(nb, D, [&](int64_t i) { return static_cast<const bf16*>(Qh.data() + i * D); }, Bq.data());
                  gemm_bf16(kk, D, nb2, At.data(), nb2, Bq.data(), true, dKe.data(), D);
                  columns_to_bf16(P.data(), nb, kk, kk, At.data(), nb2);
                  vnni_from_rows(nb, D, [&](int64_t i) { return static_cast<const bf16*>(dOh.data() + i * D); }, Bq.data());
                  gemm_bf16(kk, D, nb2, At.data(), nb2, Bq.data(), true, dVe.data(), D);
                }
            }
            if (done) continue;
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
        if constexpr (half) {
          from_compute(dQx, dQ + x * Nq * D, Nq * D);
          from_compute(dKx, dK + x * Nk * D, Nk * D);
          from_compute(dVx, dV + x * Nk * D, Nk * D);
        }
      };
      const In *Qx = Q + qr.head(b, h), *dOx = dO + dor.head(b, h), *Ox = O + outr.head(b, h);
      const In *Kx = K + kr.head(b, hkv), *Vx = Vv + vr.head(b, hkv);
      if (half && small) {
        const auto convert = [&](const In* rows, int64_t st, int64_t n, Buffer<T>& to) {
          return rows_as(rows, n, D, st, to.data());
        };
        head(convert(Qx, qs, Nq, hq), convert(dOx, dos, Nq, hdo), convert(Ox, os, Nq, ho), convert(Kx, ks, Nk, hk),
             convert(Vx, vs, Nk, hv), D, D, D, D, D);
      } else {
        head(Qx, dOx, Ox, Kx, Vx, qs, dos, os, ks, vs);
      }
    }
  });
}

}  // namespace
