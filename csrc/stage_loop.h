// StageLoop: one stage's program of replays, run by a C++ thread that never holds the GIL.
//
// On a GPU a stage's forward and backward for a micro-batch become graphs; what is left for the host per
// action is to wait for the inputs, copy them into the graph's static input buffers, replay, and post the
// outputs. Python decides what each action is (the schedule and the version book) and hands the loop a
// program; the loop runs it on its own thread, so a step no longer hands the GIL from stage to stage for
// every op. Messages go through the pipeline's existing mailboxes as native messages (lists of tensors,
// Mailbox::put_tensors), so Python threads running the eager actions and the loops exchange them alike.
//
// A program is a list of instructions:
//   take(mailbox, key, buffers)   wait for the message under key, check it against the static buffers
//                                 (count, shape, dtype, device) and copy it into them;
//   replay(graph)                 replay one of the loop's graphs (a Replayable);
//   post(mailbox, key, buffers)   post copies of the static buffers under key (the next replay overwrites
//                                 the buffers themselves).
// Instructions run in order. The first failure (a message that does not match its buffers, a replay that
// throws, a key already present) stops the loop and aborts every mailbox it uses, with a reason that names
// the stage, the instruction and what went wrong, so that the stages waiting on it stop too; an abort of one
// of its mailboxes stops the loop with that reason, and passes it on to the loop's other mailboxes. join() raises either with the GIL held (csrc/README.md,
// rule 1). The program, graphs, buffers and mailboxes are checked when the loop is started, with the GIL.
#pragma once

#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "boundary.h"
#include "mailbox.h"

namespace pipecore {

// Something the loop can replay: a captured CUDA graph, or on the CPU a stand-in. replay() runs on the loop's
// thread without the GIL; it may throw (the loop reports it), and must not touch Python objects.
class Replayable {
 public:
  virtual ~Replayable() = default;
  virtual void replay() = 0;
  virtual std::string describe() const = 0;
};

// The CPU stand-in for a graph, for testing the loop without a GPU: outputs[i] = inputs[i] * scale + shift,
// computed in place into the static outputs as a graph replay would. `fail_at` (> 0) makes that replay (1-based,
// counted over the stand-in's life) throw, to exercise the error path.
class StandInGraph : public Replayable {
 public:
  StandInGraph(std::string name, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs, double scale,
               double shift, int64_t fail_at);
  void replay() override;
  std::string describe() const override { return "graph '" + name_ + "'"; }
  int64_t replays() const { return replays_.load(); }

 private:
  std::string name_;
  std::vector<at::Tensor> inputs_, outputs_;
  double scale_, shift_;
  int64_t fail_at_;
  std::atomic<int64_t> replays_{0};
};

struct Instruction {
  enum class Kind { kTake, kReplay, kPost };
  Kind kind;
  int64_t target;                // take/post: mailbox index; replay: graph index
  int64_t key;                   // take/post: the message key
  std::vector<int64_t> buffers;  // take/post: static buffer indices, in message order
};

class StageLoop {
 public:
  // GIL held. `mailboxes` are the Python Mailbox objects; the loop keeps them alive while it exists.
  StageLoop(int64_t stage, std::vector<std::shared_ptr<Replayable>> graphs, std::vector<at::Tensor> buffers,
            const std::vector<pybind11::object>& mailboxes);
  StageLoop(const StageLoop&) = delete;
  StageLoop& operator=(const StageLoop&) = delete;
  // Aborts a running program (its mailboxes) and waits for the thread, with the GIL released.
  ~StageLoop();

  // GIL held: checks the program (raises ValueError naming the instruction) and starts it on the loop's thread
  // with the caller's torch thread-local state; RuntimeError if a program is still running or was not joined.
  void start(std::vector<Instruction> program, double timeout);
  // Waits for the program to end (GIL released); raises its failure (Aborted, TimeoutError, RuntimeError), or
  // TimeoutError when `timeout` seconds pass first (the program keeps running; join again or abort).
  void join(double timeout);
  // Aborts every mailbox of the loop with `reason`: a running program stops at its next wait.
  void abort(const std::string& reason);
  bool running() const;
  // The instructions completed by the latest program, each with the value of a process-wide counter taken
  // when it completed (a post's: when its message was posted): the order in which the loops' instructions
  // happened, for tests and diagnosis.
  std::vector<std::pair<int64_t, int64_t>> completed() const;
  int64_t stage() const { return stage_; }

 private:
  void run(std::vector<Instruction> program, double timeout, at::ThreadLocalState state);
  Status execute(const Instruction& ins, double timeout);
  std::string where(size_t index, const Instruction& ins) const;
  void finish(Status status);

  int64_t stage_;
  std::vector<std::shared_ptr<Replayable>> graphs_;
  std::vector<at::Tensor> buffers_;
  std::vector<Mailbox*> mailboxes_;
  std::vector<PyObject*> mailbox_refs_;  // strong references, dropped with the GIL in the destructor

  mutable std::mutex mu_;
  std::condition_variable done_cv_;
  bool started_ = false;  // a program was started and not yet joined
  bool done_ = true;
  Status status_;
  std::vector<std::pair<int64_t, int64_t>> completed_;
  std::thread thread_;
};

}  // namespace pipecore
