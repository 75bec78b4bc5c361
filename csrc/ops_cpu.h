// Fused element-wise kernels over flat CPU buffers (one pass over memory, at::parallel_for).
//
// All tensors are contiguous, on the CPU, with the same number of elements. Weight-like tensors
// (out, live, stale, w, v, grad) share one storage dtype (float64, float32, bfloat16, float16);
// optimizer state (momentum_buf, delta, exp_avg, exp_avg_sq) is float64 for float64 weights and
// float32 otherwise. Math runs in the state dtype. `out` may be the same tensor as an input read
// at the same index; no other overlap is allowed (checked by the Python layer).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace pipecore::cpu {

// out = live + alpha * (stale - live)
void interpolate(const at::Tensor& out, const at::Tensor& live, const at::Tensor& stale, double alpha);

// out = w - scale * v
void predict(const at::Tensor& out, const at::Tensor& w, const at::Tensor& v, double scale);

// torch.optim.SGD step from w into out; with momentum, updates momentum_buf (initialised from the
// gradient when first_step); with delta, also updates delta = decay*delta + (1-decay)*(out - w).
void sgd_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad,
              const std::optional<at::Tensor>& momentum_buf, const std::optional<at::Tensor>& delta, double lr,
              double momentum, double dampening, double weight_decay, bool nesterov, bool first_step,
              double delta_decay);

// torch.optim.AdamW step from w into out; updates exp_avg and exp_avg_sq. The step-dependent
// scalars are passed precomputed: wd_factor = 1 - lr*weight_decay, step_size = lr / (1 - beta1^step),
// bias_correction2_sqrt = (1 - beta2^step)^0.5.
void adamw_step(const at::Tensor& out, const at::Tensor& w, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, double wd_factor, double beta1, double beta2, double eps,
                double step_size, double bias_correction2_sqrt);

}  // namespace pipecore::cpu
