// Fused element-wise kernels over flat CPU buffers (one pass over memory, at::parallel_for).
//
// Each op comes in two parts (csrc/README.md, rule 2): check_<op> validates every argument and raises
// pipecore::Error (ValueError) with the GIL held; <op> computes on arguments check_<op> accepted,
// cannot fail on them and runs with the GIL released.
//
// All tensors are contiguous, on the CPU, with the same number of elements. Weight-like tensors
// (out, live, stale, w, v, grad) share one storage dtype (float64, float32, bfloat16, float16);
// optimizer state (momentum_buf, delta, exp_avg, exp_avg_sq) is float64 for float64 weights and
// float32 otherwise. Math runs in the state dtype. `out` may be the same tensor as an input read
// at the same index; no other overlap is allowed (checked here and, with friendlier messages, by the
// Python layer).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace pipecore::cpu {

// out = live + alpha * (stale - live)
void check_interpolate(const at::Tensor& out, const at::Tensor& live, const at::Tensor& stale);
void interpolate(const at::Tensor& out, const at::Tensor& live, const at::Tensor& stale, double alpha);

// out = w - scale * v
void check_predict(const at::Tensor& out, const at::Tensor& w, const at::Tensor& v);
void predict(const at::Tensor& out, const at::Tensor& w, const at::Tensor& v, double scale);

// torch.optim.SGD step from w into out; with momentum, updates momentum_buf (initialised from the
// gradient when first_step); with delta, also updates delta = decay*delta + (1-decay)*(out - w).
void check_sgd_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad,
                    const std::optional<at::Tensor>& momentum_buf, const std::optional<at::Tensor>& delta,
                    double momentum);
void sgd_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad,
              const std::optional<at::Tensor>& momentum_buf, const std::optional<at::Tensor>& delta, double lr,
              double momentum, double dampening, double weight_decay, bool nesterov, bool first_step,
              double delta_decay);

// torch.optim.AdamW step from w into out; updates exp_avg and exp_avg_sq. The step-dependent
// scalars are passed precomputed: wd_factor = 1 - lr*weight_decay, step_size = lr / (1 - beta1^step),
// bias_correction2_sqrt = (1 - beta2^step)^0.5.
void check_adamw_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq);
void adamw_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, double wd_factor, double beta1, double beta2, double eps,
                double step_size, double bias_correction2_sqrt);

// torch.optim.NAdam step from w into out; updates exp_avg and exp_avg_sq. The step-dependent scalars are
// passed precomputed (pipecore/ops/_checks.py, nadam_scalars): grad_decay (L2 weight decay added to the
// gradient, 0 for none), wd_factor = 1 - lr*weight_decay (decoupled weight decay, 1 for none),
// bias_correction2 = 1 - beta2^step, grad_step = -lr*(1 - mu_t)/(1 - mu_product) and
// exp_avg_step = -lr*mu_{t+1}/(1 - mu_product*mu_{t+1}).
void check_nadam_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq);
void nadam_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, double grad_decay, double wd_factor, double beta1, double beta2,
                double eps, double bias_correction2, double grad_step, double exp_avg_step);

// Cheap validity test for the Python layer's argument checks: true when all tensors are defined,
// contiguous, element-aligned, of one shape and device, the first n_weights share a float64/float32/bfloat16/float16
// dtype and the rest have the matching state dtype, and no tensor whose bit is set in written_mask
// overlaps another one, except tensor out_index being exactly a tensor whose bit is set in
// alias_mask. False means "not certainly valid": the caller then runs its detailed checks.
bool args_ok(const std::vector<at::Tensor>& tensors, int64_t n_weights, int64_t written_mask, int64_t out_index,
             int64_t alias_mask);

// Calls moving at least this many bytes write `out` with non-temporal (cache-bypassing) stores;
// -1 disables them. Defaults to the size of the last-level cache. Results do not depend on it.
int64_t streaming_threshold();
void set_streaming_threshold(int64_t bytes);

// Width of each streaming store: 32 bytes where the CPU has AVX, 16 (SSE2) otherwise, 0 where the
// build has none. Setting it (16, or 32 on an AVX CPU) is for tests of the narrower path.
int64_t streaming_store_bytes();
void set_streaming_store_bytes(int64_t bytes);

}  // namespace pipecore::cpu
