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
//
// The parts, one translation unit, in this order: common.h (includes, BLAS), memory.h (the outputs'
// allocator), vec.h (row helpers), topk.h (selection), merge.h (merging partial softmaxes), products.h
// (gemm and register tiles), rows.h (layouts, pooling), forward.h, backward.h; this file holds the
// argument checks, the operators' entry points and their registration.

#include "common.h"
#include "memory.h"
#include "vec.h"
#include "topk.h"
#include "merge.h"
#include "products.h"
#include "rows.h"
#include "forward.h"
#include "backward.h"

namespace {

// A 4-D tensor whose rows (the last dimension) are contiguous and apart, in any layout of the others
// (rows of stride 0, a tensor expanded along the tokens, would give the products a leading dimension
// of 0: wrong results).
bool rows_contiguous(const at::Tensor& t) {
  return t.dim() == 4 && (t.stride(3) == 1 || t.size(3) == 1) && t.stride(2) >= t.size(3);
}

// The dtype the kernels compute in for inputs of `dtype`: float64 for float64, else float32
// (bfloat16 and float16 inputs are converted block by block, see Compute in vec.h).
at::ScalarType compute_type(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& landmarks) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
              "mita fused: q must be float32, float64, bfloat16 or float16, got ", dt);
  for (const auto* t : {&q, &k, &v, &landmarks}) {
    TORCH_CHECK(t->device().is_cpu() && rows_contiguous(*t),
                "mita fused: q, k, v, landmarks must be 4-D CPU tensors with contiguous rows apart (stride(-1) == 1, "
                "stride(-2) >= size(-1)); pass t.contiguous()");
    TORCH_CHECK(t->scalar_type() == (t == &landmarks ? compute_type(dt) : dt),
                "mita fused: q, k, v must share one dtype and the landmarks be of the dtype it computes in (",
                compute_type(dt), " for ", dt, "), got ", t->scalar_type());
  }
  TORCH_CHECK(landmarks.is_contiguous(), "mita fused: landmarks must be contiguous");
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

// scale and landmark_scale, positive and finite in the compute dtype: the kernels scale differences of
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

// Merged duplicate keys (merge_duplicates): the key offsets (B, Hkv, Nk) of the compute dtype, checked,
// and the mask of the keys that take part, (B, Hkv, Nk): a finite offset (and real in key_mask). Undefined
// tensors without offsets.
std::pair<at::Tensor, at::Tensor> offsets_and_mask(const std::optional<at::Tensor>& key_offset,
                                                   const std::optional<at::Tensor>& key_mask, const at::Tensor& k,
                                                   at::ScalarType ct) {
  if (!key_offset.has_value()) return {};
  const at::Tensor& off = *key_offset;
  TORCH_CHECK(off.device().is_cpu() && off.scalar_type() == ct && off.is_contiguous() && off.dim() == 3 &&
                  off.size(0) == k.size(0) && off.size(1) == k.size(1) && off.size(2) == k.size(2),
              "mita fused: key_offset must be a contiguous (B, Hkv, Nk) tensor of dtype ", ct, ", got ",
              off.sizes(), " ", off.scalar_type());
  at::Tensor real = off.isfinite();
  if (key_mask.has_value()) real = real & key_mask->unsqueeze(1);
  return {off, real.contiguous()};
}

// Returns out, experts, routes, the landmarks (pooled here from q by the bins when none are given,
// else a copy of them), and for the backward: v~ (B, H, m, D), the log-sum-exps of s0*A per
// landmark (B, H, m) and of each query's joint softmax (B, H, Nq).
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& landmarks, const std::optional<at::Tensor>& key_mask,
                                const std::optional<at::Tensor>& query_mask, int64_t topk, int64_t num_routed,
                                double scale, double landmark_scale, const std::optional<at::Tensor>& pool_offsets,
                                const std::optional<at::Tensor>& pool_tokens,
                                const std::optional<at::Tensor>& key_offset) {
  const Bins bins = bins_data(pool_offsets, pool_tokens, q.dim() == 4 ? q.size(2) : 0);
  TORCH_CHECK(landmarks.has_value() != bool(bins), "mita fused: pass either landmarks or pooling bins");
  const auto copts = q.options().dtype(compute_type(q.scalar_type()));  // landmarks, v~, log-sum-exps
  at::Tensor lm = landmarks.has_value()
                      ? landmarks->clone()
                      : at::empty({q.size(0), q.size(1), pool_offsets->numel() - 1, q.size(3)}, copts);
  check_inputs(q, k, v, lm);
  check_scales(scale, landmark_scale, copts.dtype().toScalarType());
  const int64_t B = q.size(0), H = q.size(1), Nq = q.size(2), D = q.size(3), m = lm.size(2);
  const bool *km = mask_data(key_mask, B, k.size(2), "key_mask"), *qm = mask_data(query_mask, B, Nq, "query_mask");
  const auto merged = offsets_and_mask(key_offset, key_mask, k, copts.dtype().toScalarType());
  const at::Tensor &off = merged.first, &real = merged.second;  // (no structured bindings: lambdas capture them)
  if (real.defined()) km = real.data_ptr<bool>();
  TORCH_CHECK(!bins || !qm, "mita fused: pooling bins take no query mask (pool the masked landmarks outside)");
  TORCH_CHECK(k.size(2) < std::numeric_limits<int32_t>::max(), "mita fused: at most 2^31 - 2 keys, got Nk = ",
              k.size(2));
  TORCH_CHECK(topk >= 1 && topk <= k.size(2) && num_routed >= 1 && num_routed <= m,
              "mita fused: topk must be in [1, Nk = ", k.size(2), "] and num_routed in [1, m = ", m, "], got topk = ",
              topk, ", num_routed = ", num_routed);
  at::Tensor out = kept_empty({B, Nq, H, D}, q.options()).transpose(1, 2), v_shared = kept_empty({B, H, m, D}, copts);
  at::Tensor lse_a = kept_empty({B, H, m}, copts), lse_t = kept_empty({B, H, Nq}, copts);
  at::Tensor experts = kept_empty({B, H, m, topk}, q.options().dtype(at::kLong));
  at::Tensor routes = kept_empty({B, H, Nq, num_routed}, q.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "mita_fused_forward", [&] {
    using T = Compute<scalar_t>;
    forward_impl<T, scalar_t>(q, k, v, lm, bins, km, qm, topk, num_routed, scale, landmark_scale, out, experts, routes,
                              v_shared, lse_a, lse_t, off.defined() ? off.data_ptr<T>() : nullptr);
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
                                 const std::optional<at::Tensor>& dlandmarks,
                                 const std::optional<at::Tensor>& key_offset) {
  check_inputs(q, k, v, landmarks);
  const auto ct = compute_type(q.scalar_type());
  check_scales(scale, landmark_scale, ct);
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), Nk = k.size(2), D = q.size(3);
  const int64_t Nq = q.size(2), m = landmarks.size(2);
  const bool *km = mask_data(key_mask, B, Nk, "key_mask"), *qm = mask_data(query_mask, B, Nq, "query_mask");
  const auto merged = offsets_and_mask(key_offset, key_mask, k, ct);
  const at::Tensor &off = merged.first, &real = merged.second;
  if (real.defined()) km = real.data_ptr<bool>();
  const Bins bins = bins_data(pool_offsets, pool_tokens, Nq);
  TORCH_CHECK(!bins || (pool_offsets->numel() == m + 1 && !qm),
              "mita fused: pooling bins must give the m landmarks and take no query mask");
  TORCH_CHECK(!dlandmarks.has_value() || (bins && dlandmarks->sizes() == landmarks.sizes() &&
                                          dlandmarks->scalar_type() == ct && dlandmarks->is_contiguous()),
              "mita fused: dlandmarks goes with pooling bins and must be contiguous, of the landmarks' shape and dtype");
  for (const auto* t : {&dout, &out, &v_shared, &lse_a, &lse_t}) {
    const bool rows = t == &dout || t == &out;
    TORCH_CHECK((rows ? rows_contiguous(*t) : t->is_contiguous()) && t->scalar_type() == (rows ? q.scalar_type() : ct),
                "mita fused: dout and out must have contiguous rows and q's dtype, v_shared, lse_a, lse_t be "
                "contiguous and of the landmarks' dtype");
  }
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
  at::Tensor dq = kept_empty(q.sizes(), q.options()), dl = at::zeros_like(landmarks);
  at::Tensor dk = kept_empty({B, H, Nk, D}, q.options()), dv = kept_empty({B, H, Nk, D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "mita_fused_backward", [&] {
    using T = Compute<scalar_t>;
    backward_impl<T, scalar_t>(dout, q, k, v, landmarks, km, qm, experts, routes, out, v_shared, lse_a, lse_t, scale,
                               landmark_scale, bins, dlandmarks.has_value() ? &*dlandmarks : nullptr,
                               off.defined() ? off.data_ptr<T>() : nullptr, dq, dk, dv, dl);
  });
  if (H != Hkv) {  // grouped-query heads: each kv head's gradient is the sum over its query heads
    at::Tensor dk_kv = kept_empty({B, Hkv, Nk, D}, q.options()), dv_kv = kept_empty({B, Hkv, Nk, D}, q.options());
    dk = at::sum_out(dk_kv, dk.view({B, Hkv, H / Hkv, Nk, D}), 2);
    dv = at::sum_out(dv_kv, dv.view({B, Hkv, H / Hkv, Nk, D}), 2);
  }
  return {dq, dk, dv, dl};
}

// The outputs' kept memory (memory.h): sets its limit in bytes when given; returns {bytes kept, limit}.
std::vector<int64_t> kept_memory(std::optional<int64_t> limit) {
  TORCH_CHECK(!limit || *limit >= 0, "mita fused: the kept memory's limit must be >= 0 bytes, got ", limit.value_or(0));
  const auto [held, lim] = KeptBlocks::get().set_limit(limit ? std::optional<size_t>(*limit) : std::nullopt);
  return {int64_t(held), int64_t(lim)};
}

// Whether the kernels read a thread's next small head ahead (read_ahead, products.h): sets it when
// given (fused.read_ahead decides it per process); returns the setting.
bool set_read_ahead(std::optional<bool> on) {
  if (on) read_ahead_on().store(*on);
  return read_ahead_on().load();
}

}  // namespace

TORCH_LIBRARY(mita, m) {
  m.def(
      "fused_forward(Tensor q, Tensor k, Tensor v, Tensor? landmarks, Tensor? key_mask, Tensor? query_mask, "
      "int topk, int num_routed, float scale, float landmark_scale, Tensor? pool_offsets=None, "
      "Tensor? pool_tokens=None, Tensor? key_offset=None) -> Tensor[]");
  m.def(
      "fused_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor landmarks, Tensor? key_mask, "
      "Tensor? query_mask, Tensor experts, Tensor routes, Tensor out, Tensor v_shared, Tensor lse_a, "
      "Tensor lse_t, float scale, float landmark_scale, Tensor? pool_offsets=None, Tensor? pool_tokens=None, "
      "Tensor? dlandmarks=None, Tensor? key_offset=None) -> Tensor[]");
  m.def("kept_memory(int? limit=None) -> int[]", &kept_memory);
  m.def("read_ahead(bool? on=None) -> bool", &set_read_ahead);
}

TORCH_LIBRARY_IMPL(mita, CPU, m) {
  m.impl("fused_forward", &forward);
  m.impl("fused_backward", &backward);
}
