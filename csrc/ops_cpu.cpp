#include "ops_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "boundary.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#include <immintrin.h>
#define PC_HAVE_STREAM 1
#else
#define PC_HAVE_STREAM 0
#endif

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

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
#define PC_LAMBDA_INLINE __attribute__((always_inline))
#else
#define PC_INLINE inline
#define PC_LAMBDA_INLINE
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

// Streaming (non-temporal) stores for outputs that are only written: when a call moves more data
// than the cache holds, writing `out` around the cache saves the read-for-ownership of every line
// and leaves the cache to the inputs. Values go to an L1-resident tile first, then to memory.
// The tile is small (8 cache lines): with 8 KiB tiles the loads of a whole tile and the burst of its
// streamed stores alternated, and on an Intel Xeon streaming then lost 15-25% to ordinary stores;
// with 512 bytes it wins there by about 10%, as it did on AMD EPYC with either size
// (docs/kernels.md, implementation notes).
constexpr int64_t kTileBytes = 512;

#if PC_HAVE_STREAM && defined(__GNUC__) && defined(__x86_64__)
#define PC_HAVE_STREAM_AVX 1
// 32-byte streaming stores when the CPU has AVX: 16-byte ones were 5-8% slower on the Xeon. The kernels'
// loops are multi-versioned, so this copy is its own function compiled for AVX and chosen per tile on
// a flag read once at load (one predictable branch and a direct call per 512 bytes: not measurable).
__attribute__((target("avx"), noinline)) void stream_bytes_avx(char* d, const char* s, int64_t bytes) {
  int64_t k = 0;
  for (; k + 32 <= bytes; k += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + k), _mm256_load_si256(reinterpret_cast<const __m256i*>(s + k)));
  }
  for (; k + 16 <= bytes; k += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + k), _mm_load_si128(reinterpret_cast<const __m128i*>(s + k)));
  }
  if (k < bytes) std::memcpy(d + k, s + k, static_cast<size_t>(bytes - k));
}
// __builtin_cpu_init first: this initializer may run before libgcc's own constructor has filled in the
// CPU's features.
const bool kCpuHasAvx = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx") != 0;
}();
// Which stores stream_copy uses; the tests switch to the 16-byte ones to check them too.
std::atomic<bool> stream_avx{kCpuHasAvx};
#else
#define PC_HAVE_STREAM_AVX 0
#endif

template <typename R>
PC_INLINE void stream_copy(R* dst, const R* src, int64_t len) {
#if PC_HAVE_STREAM
  const int64_t bytes = len * static_cast<int64_t>(sizeof(R));
  char* d = reinterpret_cast<char*>(dst);
  const char* s = reinterpret_cast<const char*>(src);
#if PC_HAVE_STREAM_AVX
  if (stream_avx.load(std::memory_order_relaxed)) {
    stream_bytes_avx(d, s, bytes);
    return;
  }
#endif
  int64_t k = 0;
  for (; k + 16 <= bytes; k += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + k), _mm_load_si128(reinterpret_cast<const __m128i*>(s + k)));
  }
  if (k < bytes) std::memcpy(d + k, s + k, static_cast<size_t>(bytes - k));
#else
  std::memcpy(dst, src, static_cast<size_t>(len) * sizeof(R));
#endif
}

// Runs loop(i, len, dst) over [0, n), where the loop computes elements [i, i+len) and writes the
// new values of out[i, i+len) to dst: `out + i` itself, or, when streaming, a tile that is then
// copied to `out` with non-temporal stores. Inputs of a tile are read before the tile is stored,
// so `out` may still be one of the inputs.
template <typename R, typename Loop>
PC_INLINE void drive(int64_t n, R* out, bool stream, const Loop& loop) {
#if PC_HAVE_STREAM
  // _mm_stream_si128 faults on an address that is not 16-byte aligned. The head below reaches a cache
  // line only when `out` is aligned to its element size, which the argument checks require; the test
  // stays so that this loop is safe on its own.
  if (stream && reinterpret_cast<uintptr_t>(out) % sizeof(R) == 0) {
    constexpr int64_t kTile = kTileBytes / static_cast<int64_t>(sizeof(R));
    // Unaligned head with ordinary stores, so every streamed tile starts on a cache line.
    const int64_t misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(out) % 64);
    const int64_t head = std::min<int64_t>(n, misalign ? (64 - misalign) / static_cast<int64_t>(sizeof(R)) : 0);
    if (head > 0) loop(0, head, out);
    alignas(64) R tile[kTile];
    for (int64_t i = head; i < n; i += kTile) {
      const int64_t len = std::min<int64_t>(kTile, n - i);
      loop(i, len, tile);
      stream_copy(out + i, tile, len);
    }
    _mm_sfence();  // make the streamed stores visible before the thread reports completion
    return;
  }
#endif
  loop(0, n, out);
}

template <typename T>
PC_CLONES void interpolate_range(int64_t n, bool stream, raw_t<T>* out, const raw_t<T>* live,
                                 const raw_t<T>* stale, math_t<T> alpha) {
  using C = Cvt<T>;
  drive(n, out, stream, [&](int64_t i0, int64_t len, raw_t<T>* dst) PC_LAMBDA_INLINE {
    const raw_t<T>* l = live + i0;
    const raw_t<T>* s = stale + i0;
    PC_IVDEP
    for (int64_t i = 0; i < len; ++i) {
      const math_t<T> li = C::ld(l[i]);
      dst[i] = C::st(li + alpha * (C::ld(s[i]) - li));
    }
  });
}

template <typename T>
PC_CLONES void predict_range(int64_t n, bool stream, raw_t<T>* out, const raw_t<T>* w, const raw_t<T>* v,
                             math_t<T> scale) {
  using C = Cvt<T>;
  drive(n, out, stream, [&](int64_t i0, int64_t len, raw_t<T>* dst) PC_LAMBDA_INLINE {
    const raw_t<T>* wp = w + i0;
    const raw_t<T>* vp = v + i0;
    PC_IVDEP
    for (int64_t i = 0; i < len; ++i) dst[i] = C::st(C::ld(wp[i]) - scale * C::ld(vp[i]));
  });
}

template <typename M>
struct SgdScalars {
  M lr, momentum, one_minus_dampening, weight_decay, delta_decay, one_minus_delta_decay;
};

// The flags are template parameters so every variant is a straight-line vectorizable loop, and
// so that disabled terms are never evaluated (0 * inf would turn a weight into NaN).
template <typename T, bool WD, bool MOM, bool NESTEROV, bool FIRST, bool DELTA>
PC_CLONES void sgd_range(int64_t n, bool stream, raw_t<T>* out, const raw_t<T>* w, const raw_t<T>* grad,
                         math_t<T>* buf, math_t<T>* delta, SgdScalars<math_t<T>> s) {
  using C = Cvt<T>;
  using M = math_t<T>;
  drive(n, out, stream, [&](int64_t i0, int64_t len, raw_t<T>* dst) PC_LAMBDA_INLINE {
    const raw_t<T>* wp = w + i0;
    const raw_t<T>* gp = grad + i0;
    M* bp = MOM ? buf + i0 : nullptr;
    M* dp = DELTA ? delta + i0 : nullptr;
    PC_IVDEP
    for (int64_t i = 0; i < len; ++i) {
      const M wi = C::ld(wp[i]);
      M d = C::ld(gp[i]);
      if constexpr (WD) d = d + s.weight_decay * wi;
      if constexpr (MOM) {
        M b;
        if constexpr (FIRST) b = d;
        else b = s.momentum * bp[i] + s.one_minus_dampening * d;
        bp[i] = b;
        if constexpr (NESTEROV) d = d + s.momentum * b;
        else d = b;
      }
      const raw_t<T> nw = C::st(wi - s.lr * d);
      dst[i] = nw;
      if constexpr (DELTA) dp[i] = s.delta_decay * dp[i] + s.one_minus_delta_decay * (C::ld(nw) - wi);
    }
  });
}

template <typename M>
struct AdamScalars {
  M wd_factor, beta1_weight, beta2, one_minus_beta2, eps, neg_step_size, bc2_sqrt;
};

// LERP_SMALL picks the branch of torch's lerp formula once per call (|1 - beta1| < 0.5).
template <typename T, bool LERP_SMALL>
PC_CLONES void adamw_range(int64_t n, bool stream, raw_t<T>* out, const raw_t<T>* w, const raw_t<T>* grad,
                           math_t<T>* m, math_t<T>* v, AdamScalars<math_t<T>> s) {
  using C = Cvt<T>;
  using M = math_t<T>;
  drive(n, out, stream, [&](int64_t i0, int64_t len, raw_t<T>* dst) PC_LAMBDA_INLINE {
    const raw_t<T>* wp = w + i0;
    const raw_t<T>* gp = grad + i0;
    M* mp = m + i0;
    M* vp = v + i0;
    const M one = M(1);
    PC_IVDEP
    for (int64_t i = 0; i < len; ++i) {
      const M g = C::ld(gp[i]);
      const M p = C::ld(wp[i]) * s.wd_factor;
      // exp_avg.lerp_(grad, 1 - beta1), with torch's two-sided formula for accuracy.
      const M mi = mp[i];
      M mn;
      if constexpr (LERP_SMALL) mn = mi + s.beta1_weight * (g - mi);
      else mn = g - (g - mi) * (one - s.beta1_weight);
      const M vn = vp[i] * s.beta2 + s.one_minus_beta2 * (g * g);
      mp[i] = mn;
      vp[i] = vn;
      const M denom = std::sqrt(vn) / s.bc2_sqrt + s.eps;
      dst[i] = C::st(p + s.neg_step_size * (mn / denom));
    }
  });
}

template <typename M>
struct NadamScalars {
  M grad_decay, wd_factor, beta1_weight, beta2, one_minus_beta2, eps, bias_correction2, grad_step, exp_avg_step;
};

// torch's single-tensor NAdam, in its order: each addcdiv_(t, denom, value=c) is p + (c * t) / denom. The weight
// decay flags are template parameters so that a disabled term is never evaluated (0 * inf would be NaN).
template <typename T, bool LERP_SMALL, bool L2_DECAY, bool DECOUPLED_DECAY>
PC_CLONES void nadam_range(int64_t n, bool stream, raw_t<T>* out, const raw_t<T>* w, const raw_t<T>* grad,
                           math_t<T>* m, math_t<T>* v, NadamScalars<math_t<T>> s) {
  using C = Cvt<T>;
  using M = math_t<T>;
  drive(n, out, stream, [&](int64_t i0, int64_t len, raw_t<T>* dst) PC_LAMBDA_INLINE {
    const raw_t<T>* wp = w + i0;
    const raw_t<T>* gp = grad + i0;
    M* mp = m + i0;
    M* vp = v + i0;
    const M one = M(1);
    PC_IVDEP
    for (int64_t i = 0; i < len; ++i) {
      M p = C::ld(wp[i]);
      M g = C::ld(gp[i]);
      if constexpr (L2_DECAY) g = g + p * s.grad_decay;
      if constexpr (DECOUPLED_DECAY) p = p * s.wd_factor;
      const M mi = mp[i];
      M mn;
      if constexpr (LERP_SMALL) mn = mi + s.beta1_weight * (g - mi);
      else mn = g - (g - mi) * (one - s.beta1_weight);
      const M vn = vp[i] * s.beta2 + (g * s.one_minus_beta2) * g;
      mp[i] = mn;
      vp[i] = vn;
      const M denom = std::sqrt(vn / s.bias_correction2) + s.eps;
      p = p + (g * s.grad_step) / denom;
      p = p + (mn * s.exp_avg_step) / denom;
      dst[i] = C::st(p);
    }
  });
}

// Size of the last-level cache this CPU sees. sysfs first: under virtualization sysconf may report
// the whole host's cache.
int64_t llc_bytes() {
  if (FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
    long long kib = 0;
    const bool ok = std::fscanf(f, "%lldK", &kib) == 1;
    std::fclose(f);
    if (ok && kib > 0) return kib * 1024;
  }
#if defined(_SC_LEVEL3_CACHE_SIZE)
  const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
  if (llc > 0) return llc;
#endif
  return int64_t(32) << 20;
}

// Calls that move at least this many bytes use streaming stores for `out`. Default: the size of the
// last-level cache. Above it they measured faster for every op, by 3-15% (one thread and two, 2M
// elements and up); below it part of the data is still cached and ordinary stores are as fast or faster.
std::atomic<int64_t>& stream_threshold_ref() {
  static std::atomic<int64_t> threshold{llc_bytes()};
  return threshold;
}

bool use_streaming(int64_t bytes_moved) {
  const int64_t t = stream_threshold_ref().load(std::memory_order_relaxed);
  return PC_HAVE_STREAM && t >= 0 && bytes_moved >= t;
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

// The checks run with the GIL held, before the computation releases it (csrc/README.md, rule 2); they
// are the safety net for direct callers of pipecore._C, the Python layer gives friendlier errors first.
void check_flat(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like,
                at::ScalarType dtype) {
  PIPECORE_CHECK(t.defined(), ErrorKind::kValue, op, ": argument '", name, "' is undefined");
  PIPECORE_CHECK(t.device().is_cpu(), ErrorKind::kValue, op, ": argument '", name, "' must be a CPU tensor, got ",
                 t.device());
  PIPECORE_CHECK(t.is_contiguous(), ErrorKind::kValue, op, ": argument '", name, "' must be contiguous");
  // A misaligned element access is undefined behaviour, and faults with the aligned vector stores the
  // compiler may emit; torch's own allocations are always aligned.
  PIPECORE_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % t.element_size() == 0, ErrorKind::kValue, op,
                 ": argument '", name, "' is not aligned to its ", t.element_size(), "-byte elements");
  PIPECORE_CHECK(t.numel() == like.numel(), ErrorKind::kValue, op, ": argument '", name, "' has ", t.numel(),
                 " elements, expected ", like.numel());
  PIPECORE_CHECK(t.scalar_type() == dtype, ErrorKind::kValue, op, ": argument '", name, "' has dtype ",
                 t.scalar_type(), ", expected ", dtype);
}

at::ScalarType state_dtype(at::ScalarType weights) {
  return weights == at::kDouble ? at::kDouble : at::kFloat;
}

void check_weight_dtype(const char* op, const at::Tensor& t) {
  PIPECORE_CHECK(t.defined(), ErrorKind::kValue, op, ": the weights argument is undefined");
  const auto d = t.scalar_type();
  PIPECORE_CHECK(d == at::kDouble || d == at::kFloat || d == at::kBFloat16 || d == at::kHalf, ErrorKind::kValue, op,
                 ": weights must be float64, float32, bfloat16 or float16, got ", d);
}

// A tensor the kernel writes may not overlap another argument, except `out` being exactly an input it
// reads at the same index (the loops read an element before writing it). Arguments are checked flat and
// contiguous first, so [data_ptr, data_ptr + nbytes) is each one's memory.
struct Arg {
  const char* name;
  const at::Tensor* tensor;  // nullptr or undefined: absent
  bool written;
  bool out_may_alias;  // an input `out` may be exactly
};

void check_no_overlap(const char* op, std::initializer_list<Arg> args) {
  auto range = [](const Arg& a) {
    const auto start = reinterpret_cast<uintptr_t>(a.tensor->data_ptr());
    return std::make_pair(start, start + static_cast<uintptr_t>(a.tensor->nbytes()));
  };
  auto present = [](const Arg& a) { return a.tensor != nullptr && a.tensor->defined() && a.tensor->numel() > 0; };
  const Arg* out = args.begin();  // `out` comes first
  for (const Arg& w : args) {
    if (!w.written || !present(w)) continue;
    const auto rw = range(w);
    for (const Arg& other : args) {
      if (&other == &w || !present(other)) continue;
      const auto ro = range(other);
      if (!(ro.first < rw.second && rw.first < ro.second)) continue;
      const bool allowed = (&w == out && other.out_may_alias && ro == rw) || (&other == out && w.out_may_alias && ro == rw);
      PIPECORE_CHECK(allowed, ErrorKind::kValue, op, ": argument '", w.name, "' is written and overlaps argument '",
                     other.name, "'; only 'out' may be exactly an input it replaces");
    }
  }
}

}  // namespace

void check_interpolate(const at::Tensor& out, const at::Tensor& live, const at::Tensor& stale) {
  const char* op = "interpolate";
  check_weight_dtype(op, live);
  check_flat(op, "live", live, live, live.scalar_type());
  check_flat(op, "stale", stale, live, live.scalar_type());
  check_flat(op, "out", out, live, live.scalar_type());
  check_no_overlap(op, {{"out", &out, true, false}, {"live", &live, false, true}, {"stale", &stale, false, true}});
}

void interpolate(const at::Tensor& out, const at::Tensor& live, const at::Tensor& stale, double alpha) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, live.scalar_type(), "pipecore_interpolate", [&] {
    auto* o = ptr<scalar_t>(out);
    const auto* l = ptr<scalar_t>(live);
    const auto* s = ptr<scalar_t>(stale);
    const auto a = static_cast<math_t<scalar_t>>(alpha);
    const bool st = use_streaming(3 * live.nbytes());
    parallel(live.numel(), [&](int64_t b, int64_t n) { interpolate_range<scalar_t>(n, st, o + b, l + b, s + b, a); });
  });
}

void check_predict(const at::Tensor& out, const at::Tensor& w, const at::Tensor& v) {
  const char* op = "predict";
  check_weight_dtype(op, w);
  check_flat(op, "w", w, w, w.scalar_type());
  check_flat(op, "v", v, w, w.scalar_type());
  check_flat(op, "out", out, w, w.scalar_type());
  check_no_overlap(op, {{"out", &out, true, false}, {"w", &w, false, true}, {"v", &v, false, true}});
}

void predict(const at::Tensor& out, const at::Tensor& w, const at::Tensor& v, double scale) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "pipecore_predict", [&] {
    auto* o = ptr<scalar_t>(out);
    const auto* wp = ptr<scalar_t>(w);
    const auto* vp = ptr<scalar_t>(v);
    const auto sc = static_cast<math_t<scalar_t>>(scale);
    const bool st = use_streaming(3 * w.nbytes());
    parallel(w.numel(), [&](int64_t b, int64_t n) { predict_range<scalar_t>(n, st, o + b, wp + b, vp + b, sc); });
  });
}

namespace {

template <typename T, bool WD, bool MOM, bool NESTEROV, bool FIRST>
void sgd_launch_delta(bool has_delta, bool st, int64_t numel, raw_t<T>* o, const raw_t<T>* w, const raw_t<T>* g,
                      math_t<T>* buf, math_t<T>* delta, const SgdScalars<math_t<T>>& s) {
  parallel(numel, [&](int64_t b, int64_t n) {
    math_t<T>* bb = buf ? buf + b : nullptr;
    if (has_delta) sgd_range<T, WD, MOM, NESTEROV, FIRST, true>(n, st, o + b, w + b, g + b, bb, delta + b, s);
    else sgd_range<T, WD, MOM, NESTEROV, FIRST, false>(n, st, o + b, w + b, g + b, bb, nullptr, s);
  });
}

template <typename T, bool WD>
void sgd_launch(bool mom, bool nesterov, bool first, bool has_delta, bool st, int64_t numel, raw_t<T>* o,
                const raw_t<T>* w, const raw_t<T>* g, math_t<T>* buf, math_t<T>* delta,
                const SgdScalars<math_t<T>>& s) {
  if (!mom) {
    sgd_launch_delta<T, WD, false, false, false>(has_delta, st, numel, o, w, g, buf, delta, s);
  } else if (first) {
    if (nesterov) sgd_launch_delta<T, WD, true, true, true>(has_delta, st, numel, o, w, g, buf, delta, s);
    else sgd_launch_delta<T, WD, true, false, true>(has_delta, st, numel, o, w, g, buf, delta, s);
  } else {
    if (nesterov) sgd_launch_delta<T, WD, true, true, false>(has_delta, st, numel, o, w, g, buf, delta, s);
    else sgd_launch_delta<T, WD, true, false, false>(has_delta, st, numel, o, w, g, buf, delta, s);
  }
}

}  // namespace

void check_sgd_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad,
                    const std::optional<at::Tensor>& momentum_buf, const std::optional<at::Tensor>& delta,
                    double momentum) {
  const char* op = "sgd_step";
  check_weight_dtype(op, w);
  const auto sd = state_dtype(w.scalar_type());
  check_flat(op, "w", w, w, w.scalar_type());
  check_flat(op, "grad", grad, w, w.scalar_type());
  check_flat(op, "out", out, w, w.scalar_type());
  const bool mom = momentum != 0.0;
  PIPECORE_CHECK(!mom || (momentum_buf.has_value() && momentum_buf->defined()), ErrorKind::kValue, op,
                 ": argument 'momentum_buf' is required when momentum != 0");
  if (mom) check_flat(op, "momentum_buf", *momentum_buf, w, sd);
  const bool has_delta = delta.has_value() && delta->defined();
  if (has_delta) check_flat(op, "delta", *delta, w, sd);
  const at::Tensor* buf = mom ? &*momentum_buf : nullptr;
  const at::Tensor* dl = has_delta ? &*delta : nullptr;
  check_no_overlap(op, {{"out", &out, true, false}, {"w", &w, false, true}, {"grad", &grad, false, false},
                        {"momentum_buf", buf, true, false}, {"delta", dl, true, false}});
}

void sgd_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad,
              const std::optional<at::Tensor>& momentum_buf, const std::optional<at::Tensor>& delta, double lr,
              double momentum, double dampening, double weight_decay, bool nesterov, bool first_step,
              double delta_decay) {
  const bool mom = momentum != 0.0;
  const bool has_delta = delta.has_value() && delta->defined();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "pipecore_sgd_step", [&] {
    using M = math_t<scalar_t>;
    SgdScalars<M> s{static_cast<M>(lr),          static_cast<M>(momentum),   static_cast<M>(1.0 - dampening),
                    static_cast<M>(weight_decay), static_cast<M>(delta_decay), static_cast<M>(1.0 - delta_decay)};
    M* buf = mom ? state_ptr<scalar_t>(*momentum_buf) : nullptr;
    M* dl = has_delta ? state_ptr<scalar_t>(*delta) : nullptr;
    const int64_t state_bytes = w.numel() * static_cast<int64_t>(sizeof(M));
    const bool st = use_streaming(3 * w.nbytes() + (mom ? 2 * state_bytes : 0) + (has_delta ? 2 * state_bytes : 0));
    if (weight_decay != 0.0) {
      sgd_launch<scalar_t, true>(mom, nesterov, first_step, has_delta, st, w.numel(), ptr<scalar_t>(out),
                                 ptr<scalar_t>(w), ptr<scalar_t>(grad), buf, dl, s);
    } else {
      sgd_launch<scalar_t, false>(mom, nesterov, first_step, has_delta, st, w.numel(), ptr<scalar_t>(out),
                                  ptr<scalar_t>(w), ptr<scalar_t>(grad), buf, dl, s);
    }
  });
}

void check_adamw_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq) {
  const char* op = "adamw_step";
  check_weight_dtype(op, w);
  const auto sd = state_dtype(w.scalar_type());
  check_flat(op, "w", w, w, w.scalar_type());
  check_flat(op, "grad", grad, w, w.scalar_type());
  check_flat(op, "out", out, w, w.scalar_type());
  check_flat(op, "exp_avg", exp_avg, w, sd);
  check_flat(op, "exp_avg_sq", exp_avg_sq, w, sd);
  check_no_overlap(op, {{"out", &out, true, false}, {"w", &w, false, true}, {"grad", &grad, false, false},
                        {"exp_avg", &exp_avg, true, false}, {"exp_avg_sq", &exp_avg_sq, true, false}});
}

void adamw_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, double wd_factor, double beta1, double beta2, double eps,
                double step_size, double bias_correction2_sqrt) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "pipecore_adamw_step", [&] {
    using M = math_t<scalar_t>;
    // torch computes 1 - beta1 and 1 - beta2 in double and rounds them to the math type.
    const double weight = 1.0 - beta1;
    AdamScalars<M> s{static_cast<M>(wd_factor),   static_cast<M>(weight), static_cast<M>(beta2),
                     static_cast<M>(1.0 - beta2), static_cast<M>(eps),    static_cast<M>(-step_size),
                     static_cast<M>(bias_correction2_sqrt)};
    const bool small = std::abs(static_cast<M>(weight)) < M(0.5);
    auto* o = ptr<scalar_t>(out);
    const auto* wp = ptr<scalar_t>(w);
    const auto* gp = ptr<scalar_t>(grad);
    M* m = state_ptr<scalar_t>(exp_avg);
    M* v = state_ptr<scalar_t>(exp_avg_sq);
    const bool st = use_streaming(3 * w.nbytes() + 4 * exp_avg.nbytes());
    parallel(w.numel(), [&](int64_t b, int64_t n) {
      if (small) adamw_range<scalar_t, true>(n, st, o + b, wp + b, gp + b, m + b, v + b, s);
      else adamw_range<scalar_t, false>(n, st, o + b, wp + b, gp + b, m + b, v + b, s);
    });
  });
}

void check_nadam_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq) {
  const char* op = "nadam_step";
  check_weight_dtype(op, w);
  const auto sd = state_dtype(w.scalar_type());
  check_flat(op, "w", w, w, w.scalar_type());
  check_flat(op, "grad", grad, w, w.scalar_type());
  check_flat(op, "out", out, w, w.scalar_type());
  check_flat(op, "exp_avg", exp_avg, w, sd);
  check_flat(op, "exp_avg_sq", exp_avg_sq, w, sd);
  check_no_overlap(op, {{"out", &out, true, false}, {"w", &w, false, true}, {"grad", &grad, false, false},
                        {"exp_avg", &exp_avg, true, false}, {"exp_avg_sq", &exp_avg_sq, true, false}});
}

namespace {

template <typename T, bool LERP_SMALL>
void nadam_launch(bool l2_decay, bool decoupled_decay, bool st, int64_t numel, raw_t<T>* o, const raw_t<T>* w,
                  const raw_t<T>* g, math_t<T>* m, math_t<T>* v, const NadamScalars<math_t<T>>& s) {
  parallel(numel, [&](int64_t b, int64_t n) {
    if (l2_decay && decoupled_decay) {
      nadam_range<T, LERP_SMALL, true, true>(n, st, o + b, w + b, g + b, m + b, v + b, s);
    } else if (l2_decay) {
      nadam_range<T, LERP_SMALL, true, false>(n, st, o + b, w + b, g + b, m + b, v + b, s);
    } else if (decoupled_decay) {
      nadam_range<T, LERP_SMALL, false, true>(n, st, o + b, w + b, g + b, m + b, v + b, s);
    } else {
      nadam_range<T, LERP_SMALL, false, false>(n, st, o + b, w + b, g + b, m + b, v + b, s);
    }
  });
}

}  // namespace

void nadam_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, double grad_decay, double wd_factor, double beta1, double beta2,
                double eps, double bias_correction2, double grad_step, double exp_avg_step) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "pipecore_nadam_step", [&] {
    using M = math_t<scalar_t>;
    // torch computes 1 - beta1 and 1 - beta2 in double and rounds them to the math type.
    const double weight = 1.0 - beta1;
    NadamScalars<M> s{static_cast<M>(grad_decay),      static_cast<M>(wd_factor),   static_cast<M>(weight),
                      static_cast<M>(beta2),           static_cast<M>(1.0 - beta2), static_cast<M>(eps),
                      static_cast<M>(bias_correction2), static_cast<M>(grad_step),   static_cast<M>(exp_avg_step)};
    // pipecore.ops passes one kind of weight decay at most: L2 (added to the gradient) or decoupled (a factor
    // on the weights); a disabled one is skipped, as torch skips it.
    const bool l2_decay = grad_decay != 0.0;
    const bool decoupled_decay = wd_factor != 1.0;
    auto* o = ptr<scalar_t>(out);
    const auto* wp = ptr<scalar_t>(w);
    const auto* gp = ptr<scalar_t>(grad);
    M* m = state_ptr<scalar_t>(exp_avg);
    M* v = state_ptr<scalar_t>(exp_avg_sq);
    const bool st = use_streaming(3 * w.nbytes() + 4 * exp_avg.nbytes());
    if (std::abs(static_cast<M>(weight)) < M(0.5)) {
      nadam_launch<scalar_t, true>(l2_decay, decoupled_decay, st, w.numel(), o, wp, gp, m, v, s);
    } else {
      nadam_launch<scalar_t, false>(l2_decay, decoupled_decay, st, w.numel(), o, wp, gp, m, v, s);
    }
  });
}

bool args_ok(const std::vector<at::Tensor>& tensors, int64_t n_weights, int64_t written_mask, int64_t out_index,
             int64_t alias_mask) {
  const int64_t count = static_cast<int64_t>(tensors.size());
  if (count == 0 || count > 62 || n_weights < 1 || n_weights > count) return false;
  const at::Tensor& ref = tensors[0];
  if (!ref.defined()) return false;
  const auto dtype = ref.scalar_type();
  if (dtype != at::kDouble && dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) return false;
  const auto sdt = state_dtype(dtype);
  const auto device = ref.device();
  if (device.is_meta()) return false;
  const auto sizes = ref.sizes();
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const at::Tensor& t = tensors[i];
    if (!t.defined() || t.scalar_type() != (i < n_weights ? dtype : sdt) || t.device() != device ||
        t.sizes() != sizes || !t.is_contiguous()) {
      return false;
    }
    const auto start = reinterpret_cast<uintptr_t>(t.data_ptr());
    if (start % t.element_size() != 0) return false;  // misaligned: the detailed checks say so
    ranges[i] = {start, start + t.nbytes()};
  }
  for (int64_t w = 0; w < count; ++w) {
    if (!((written_mask >> w) & 1)) continue;
    for (int64_t j = 0; j < count; ++j) {
      if (j == w || !(ranges[j].first < ranges[w].second && ranges[w].first < ranges[j].second)) continue;
      if (w == out_index && ((alias_mask >> j) & 1) && ranges[j] == ranges[w]) continue;
      return false;
    }
  }
  return true;
}

int64_t streaming_threshold() { return stream_threshold_ref().load(); }

void set_streaming_threshold(int64_t bytes) { stream_threshold_ref().store(bytes); }

int64_t streaming_store_bytes() {
#if PC_HAVE_STREAM_AVX
  if (stream_avx.load()) return 32;
#endif
  return PC_HAVE_STREAM ? 16 : 0;
}

void set_streaming_store_bytes(int64_t bytes) {
#if PC_HAVE_STREAM_AVX
  PIPECORE_CHECK(bytes == 16 || (bytes == 32 && kCpuHasAvx), ErrorKind::kValue,
                 "streaming stores: width must be 16", kCpuHasAvx ? " or 32" : " (this CPU has no AVX)",
                 " bytes, got ", bytes);
  stream_avx.store(bytes == 32);
#else
  PIPECORE_CHECK(bytes == streaming_store_bytes(), ErrorKind::kValue,
                 "streaming stores: this build has one width, ", streaming_store_bytes(), " bytes, got ", bytes);
#endif
}

}  // namespace pipecore::cpu
