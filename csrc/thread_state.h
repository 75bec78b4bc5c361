// ThreadState: the calling thread's torch thread-local state, carried into a stage worker thread.
//
// Grad mode, autocast, the active profiler (its record-function callbacks) and the dispatch key sets
// are thread-local in torch. A stage worker thread starts with none of the caller's, so a `no_grad`,
// an `autocast` or a `torch.profiler.profile` around `step()` would apply when the stages run in turn
// on the caller's thread but not when they run on their own threads. Capturing the caller's state and
// entering it on each worker (as torch's own async tasks do) makes both ways of running the same.
// The intra-op thread count (torch.set_num_threads) is per OS thread for OpenMP and MKL: a new thread
// would use every core, so entering also applies the process's setting, as torch's own threads do.
// The guard that enter() returns records the thread that entered it: leaving it on another thread
// raises instead of overwriting that thread's state, and a guard dropped without being left (its Python
// object collected later, on any thread) restores nothing (csrc/README.md, rule 7).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/record_function.h>

#include <memory>
#include <optional>
#include <thread>

#include "boundary.h"

namespace pipecore {

class ThreadState {
 public:
  // Captures the calling thread's state.
  ThreadState() = default;

  // Makes the captured state current on the entering thread until exit() on that same thread.
  class Guard {
   public:
    explicit Guard(const at::ThreadLocalState& state) : previous_(std::in_place), thread_(std::this_thread::get_id()) {
      at::ThreadLocalState::setThreadLocalState(state);
      at::init_num_threads();
    }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;

    // Restores the state the entering thread had. Raises RuntimeError on another thread or when already left.
    void exit() {
      PIPECORE_CHECK(previous_.has_value(), ErrorKind::kRuntime, "ThreadState: this guard was already left");
      PIPECORE_CHECK(std::this_thread::get_id() == thread_, ErrorKind::kRuntime,
                     "ThreadState: a guard must be left on the thread that entered it");
      at::ThreadLocalState::setThreadLocalState(*previous_);
      previous_.reset();
    }

   private:
    std::optional<at::ThreadLocalState> previous_;  // empty once left
    std::thread::id thread_;
  };

  std::unique_ptr<Guard> enter() const { return std::make_unique<Guard>(state_); }

 private:
  at::ThreadLocalState state_;
};

// RecordingOff: no record-function callbacks (no profiler events) on the calling thread inside the block.
// For communication posted ahead of time (a receive kept posted between steps): a c10d work started while a
// profiler records ends its event when it completes, on another thread, possibly after the profiler
// stopped; torch 2.13's profiler results then crash when freed.
class RecordingOff {
 public:
  void enter() {
    previous_ = at::isRecordFunctionEnabled();
    at::enableRecordFunction(false);
  }
  void exit() { at::enableRecordFunction(previous_); }

 private:
  bool previous_ = true;
};

}  // namespace pipecore
