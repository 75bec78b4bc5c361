#include "ops_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// Each inner loop is compiled for AVX-512, AVX2 and baseline x86-64; the loader picks one at
// run time (GCC function multi-versioning), so one wheel is fast everywhere. Loops are written
// so the compiler vectorizes them: flat indices, no calls, invariant branches only.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define PC_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PC_CLONES
#endif

// `out` may be the very tensor an input is read from; every element is read before it is
// written at the same index, so there is no loop-carried dependency and the loop may be vectorized.
#if defined(__clang__)
#define PC_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define PC_IVDEP _Pragma("GCC ivdep")
#else
#define PC_IVDEP
#endif

#if defined(__GNUC__)
#define PC_INLINE inline __attribute__((always_inline))
#else
#define PC_INLINE inline
#endif

namespace pipecore::cpu {
namespace {

// Storage <-> math conversion. bf16/fp16 buffers are accessed as raw 16-bit words so that the
// conversions are plain integer/float arithmetic the vectorizer understands.
template <typename T>
struct Cvt {
  using raw = T;
  using math = T;
  static PC_INLINE math ld(raw x) { return x; }
  static PC_INLINE raw st(math x) { return x; }
};

template <>
struct Cvt<c10::BFloat16> {
  using raw = uint16_t;
  using math = float;
  static PC_INLINE math ld(raw x) {
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
  // Round to nearest even, NaN -> canonical quiet NaN: same as c10::BFloat16(float).
  static PC_INLINE raw st(math f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return f != f ? static_cast<raw>(0x7FC0) : static_cast<raw>(r);
  }
};

template <>
struct Cvt<c10::Half> {
  using raw = uint16_t;
  using math = float;
  static PC_INLINE math ld(raw x) { return c10::detail::fp16_ieee_to_fp32_value(x); }
  static PC_INLINE raw st(math f) { return c10::detail::fp16_ieee_from_fp32_value(f); }
};

template <typename T>
using raw_t = typename Cvt<T>::raw;
template <typename T>
using math_t = typename Cvt<T>::math;

template <typename T>
PC_CLONES void interpolate_range(int64_t n, raw_t<T>* out, const raw_t<T>* live, const raw_t<T>* stale,
                                 math_t<T> alpha) {
  using C = Cvt<T>;
  PC_IVDEP
  for (int64_t i = 0; i < n; ++i) {
    const math_t<T> l = C::ld(live[i]);
    const math_t<T> s = C::ld(stale[i]);
    out[i] = C::st(l + alpha * (s - l));
  }
}

template <typename T>
PC_CLONES void predict_range(int64_t n, raw_t<T>* out, const raw_t<T>* w, const raw_t<T>* v, math_t<T> scale) {
  using C = Cvt<T>;
  PC_IVDEP
  for (int64_t i = 0; i < n; ++i) {
    out[i] = C::st(C::ld(w[i]) - scale * C::ld(v[i]));
  }
}

template <typename M>
struct SgdScalars {
  M lr, momentum, one_minus_dampening, weight_decay, delta_decay, one_minus_delta_decay;
};

// The flags are template parameters so every variant is a straight-line vectorizable loop, and
// so that disabled terms are never evaluated (0 * inf would turn a weight into NaN).
template <typename T, bool WD, bool MOM, bool NESTEROV, bool FIRST, bool DELTA>
PC_CLONES void sgd_range(int64_t n, raw_t<T>* out, const raw_t<T>* w, const raw_t<T>* grad, math_t<T>* buf,
                         math_t<T>* delta, SgdScalars<math_t<T>> s) {
  using C = Cvt<T>;
  using M = math_t<T>;
  PC_IVDEP
  for (int64_t i = 0; i < n; ++i) {
    const M wi = C::ld(w[i]);
    M d = C::ld(grad[i]);
    if constexpr (WD) d = d + s.weight_decay * wi;
    if constexpr (MOM) {
      M b;
      if constexpr (FIRST) b = d;
      else b = s.momentum * buf[i] + s.one_minus_dampening * d;
      buf[i] = b;
      if constexpr (NESTEROV) d = d + s.momentum * b;
      else d = b;
    }
    const raw_t<T> nw = C::st(wi - s.lr * d);
    out[i] = nw;
    if constexpr (DELTA) delta[i] = s.delta_decay * delta[i] + s.one_minus_delta_decay * (C::ld(nw) - wi);
  }
}

template <typename M>
struct AdamScalars {
  M wd_factor, beta1_weight, beta2, one_minus_beta2, eps, neg_step_size, bc2_sqrt;
  bool lerp_small;
};

template <typename T>
PC_CLONES void adamw_range(int64_t n, raw_t<T>* out, const raw_t<T>* w, const raw_t<T>* grad, math_t<T>* m,
                           math_t<T>* v, AdamScalars<math_t<T>> s) {
  using C = Cvt<T>;
  using M = math_t<T>;
  const M one = M(1);
  PC_IVDEP
  for (int64_t i = 0; i < n; ++i) {
    const M g = C::ld(grad[i]);
    const M p = C::ld(w[i]) * s.wd_factor;
    // exp_avg.lerp_(grad, 1 - beta1), with torch's two-sided formula for accuracy.
    const M mi = m[i];
    const M mn = s.lerp_small ? mi + s.beta1_weight * (g - mi) : g - (g - mi) * (one - s.beta1_weight);
    const M vn = v[i] * s.beta2 + s.one_minus_beta2 * (g * g);
    m[i] = mn;
    v[i] = vn;
    const M denom = std::sqrt(vn) / s.bc2_sqrt + s.eps;
    out[i] = C::st(p + s.neg_step_size * (mn / denom));
  }
}

// Splits [0, n) over the intra-op thread pool. Large grains keep each thread streaming through
// one contiguous range.
constexpr int64_t kGrain = 1 << 16;

template <typename F>
void parallel(int64_t n, const F& f) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) { f(begin, end - begin); });
}

template <typename T>
raw_t<T>* ptr(const at::Tensor& t) {
  return reinterpret_cast<raw_t<T>*>(t.data_ptr());
}

template <typename T>
math_t<T>* state_ptr(const at::Tensor& t) {
  return reinterpret_cast<math_t<T>*>(t.data_ptr());
}

// Safety net for direct callers of pipecore._C; the Python layer already gives friendlier errors.
void check_flat(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like,
                at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.defined(), op, ": argument '", name, "' is undefined");
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": argument '", name, "' must be a CPU tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": argument '", name, "' must be contiguous");
  TORCH_CHECK_VALUE(t.numel() == like.numel(), op, ": argument '", name, "' has ", t.numel(),
                    " elements, expected ", like.numel());
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": argument '", name, "' has dtype ", t.scalar_type(),
                    ", expected ", dtype);
}

at::ScalarType state_dtype(at::ScalarType weights) {
  return weights == at::kDouble ? at::kDouble : at::kFloat;
}

void check_weight_dtype(const char* op, const at::Tensor& t) {
  const auto d = t.scalar_type();
  TORCH_CHECK_VALUE(d == at::kDouble || d == at::kFloat || d == at::kBFloat16 || d == at::kHalf, op,
                    ": weights must be float64, float32, bfloat16 or float16, got ", d);
}

}  // namespace

void interpolate(const at::Tensor& out, const at::Tensor& live, const at::Tensor& stale, double alpha) {
  const char* op = "interpolate";
  check_weight_dtype(op, live);
  check_flat(op, "live", live, live, live.scalar_type());
  check_flat(op, "stale", stale, live, live.scalar_type());
  check_flat(op, "out", out, live, live.scalar_type());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, live.scalar_type(), "pipecore_interpolate", [&] {
    auto* o = ptr<scalar_t>(out);
    const auto* l = ptr<scalar_t>(live);
    const auto* s = ptr<scalar_t>(stale);
    const auto a = static_cast<math_t<scalar_t>>(alpha);
    parallel(live.numel(), [&](int64_t b, int64_t n) { interpolate_range<scalar_t>(n, o + b, l + b, s + b, a); });
  });
}

void predict(const at::Tensor& out, const at::Tensor& w, const at::Tensor& v, double scale) {
  const char* op = "predict";
  check_weight_dtype(op, w);
  check_flat(op, "w", w, w, w.scalar_type());
  check_flat(op, "v", v, w, w.scalar_type());
  check_flat(op, "out", out, w, w.scalar_type());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "pipecore_predict", [&] {
    auto* o = ptr<scalar_t>(out);
    const auto* wp = ptr<scalar_t>(w);
    const auto* vp = ptr<scalar_t>(v);
    const auto sc = static_cast<math_t<scalar_t>>(scale);
    parallel(w.numel(), [&](int64_t b, int64_t n) { predict_range<scalar_t>(n, o + b, wp + b, vp + b, sc); });
  });
}

namespace {

template <typename T, bool WD, bool MOM, bool NESTEROV, bool FIRST>
void sgd_launch_delta(bool has_delta, int64_t numel, raw_t<T>* o, const raw_t<T>* w, const raw_t<T>* g,
                      math_t<T>* buf, math_t<T>* delta, const SgdScalars<math_t<T>>& s) {
  parallel(numel, [&](int64_t b, int64_t n) {
    if (has_delta) {
      sgd_range<T, WD, MOM, NESTEROV, FIRST, true>(n, o + b, w + b, g + b, buf ? buf + b : nullptr, delta + b, s);
    } else {
      sgd_range<T, WD, MOM, NESTEROV, FIRST, false>(n, o + b, w + b, g + b, buf ? buf + b : nullptr, nullptr, s);
    }
  });
}

template <typename T, bool WD>
void sgd_launch(bool mom, bool nesterov, bool first, bool has_delta, int64_t numel, raw_t<T>* o, const raw_t<T>* w,
                const raw_t<T>* g, math_t<T>* buf, math_t<T>* delta, const SgdScalars<math_t<T>>& s) {
  if (!mom) {
    sgd_launch_delta<T, WD, false, false, false>(has_delta, numel, o, w, g, buf, delta, s);
  } else if (first) {
    if (nesterov) sgd_launch_delta<T, WD, true, true, true>(has_delta, numel, o, w, g, buf, delta, s);
    else sgd_launch_delta<T, WD, true, false, true>(has_delta, numel, o, w, g, buf, delta, s);
  } else {
    if (nesterov) sgd_launch_delta<T, WD, true, true, false>(has_delta, numel, o, w, g, buf, delta, s);
    else sgd_launch_delta<T, WD, true, false, false>(has_delta, numel, o, w, g, buf, delta, s);
  }
}

}  // namespace

void sgd_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad,
              const std::optional<at::Tensor>& momentum_buf, const std::optional<at::Tensor>& delta, double lr,
              double momentum, double dampening, double weight_decay, bool nesterov, bool first_step,
              double delta_decay) {
  const char* op = "sgd_step";
  check_weight_dtype(op, w);
  const auto sd = state_dtype(w.scalar_type());
  check_flat(op, "w", w, w, w.scalar_type());
  check_flat(op, "grad", grad, w, w.scalar_type());
  check_flat(op, "out", out, w, w.scalar_type());
  const bool mom = momentum != 0.0;
  TORCH_CHECK_VALUE(!mom || (momentum_buf.has_value() && momentum_buf->defined()), op,
                    ": argument 'momentum_buf' is required when momentum != 0");
  if (mom) check_flat(op, "momentum_buf", *momentum_buf, w, sd);
  const bool has_delta = delta.has_value() && delta->defined();
  if (has_delta) check_flat(op, "delta", *delta, w, sd);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "pipecore_sgd_step", [&] {
    using M = math_t<scalar_t>;
    SgdScalars<M> s{static_cast<M>(lr),          static_cast<M>(momentum),   static_cast<M>(1.0 - dampening),
                    static_cast<M>(weight_decay), static_cast<M>(delta_decay), static_cast<M>(1.0 - delta_decay)};
    M* buf = mom ? state_ptr<scalar_t>(*momentum_buf) : nullptr;
    M* dl = has_delta ? state_ptr<scalar_t>(*delta) : nullptr;
    if (weight_decay != 0.0) {
      sgd_launch<scalar_t, true>(mom, nesterov, first_step, has_delta, w.numel(), ptr<scalar_t>(out),
                                 ptr<scalar_t>(w), ptr<scalar_t>(grad), buf, dl, s);
    } else {
      sgd_launch<scalar_t, false>(mom, nesterov, first_step, has_delta, w.numel(), ptr<scalar_t>(out),
                                  ptr<scalar_t>(w), ptr<scalar_t>(grad), buf, dl, s);
    }
  });
}

void adamw_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, double wd_factor, double beta1, double beta2, double eps,
                double step_size, double bias_correction2_sqrt) {
  const char* op = "adamw_step";
  check_weight_dtype(op, w);
  const auto sd = state_dtype(w.scalar_type());
  check_flat(op, "w", w, w, w.scalar_type());
  check_flat(op, "grad", grad, w, w.scalar_type());
  check_flat(op, "out", out, w, w.scalar_type());
  check_flat(op, "exp_avg", exp_avg, w, sd);
  check_flat(op, "exp_avg_sq", exp_avg_sq, w, sd);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "pipecore_adamw_step", [&] {
    using M = math_t<scalar_t>;
    // torch computes 1 - beta1 and 1 - beta2 in double and rounds them to the math type.
    const double weight = 1.0 - beta1;
    AdamScalars<M> s{static_cast<M>(wd_factor), static_cast<M>(weight),    static_cast<M>(beta2),
                     static_cast<M>(1.0 - beta2), static_cast<M>(eps),     static_cast<M>(-step_size),
                     static_cast<M>(bias_correction2_sqrt), std::abs(static_cast<M>(weight)) < M(0.5)};
    auto* o = ptr<scalar_t>(out);
    const auto* wp = ptr<scalar_t>(w);
    const auto* gp = ptr<scalar_t>(grad);
    M* m = state_ptr<scalar_t>(exp_avg);
    M* v = state_ptr<scalar_t>(exp_avg_sq);
    parallel(w.numel(), [&](int64_t b, int64_t n) { adamw_range<scalar_t>(n, o + b, wp + b, gp + b, m + b, v + b, s); });
  });
}

}  // namespace pipecore::cpu
