#include "stage_loop.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <chrono>
#include <cmath>
#include <exception>
#include <sstream>

namespace py = pybind11;

namespace pipecore {

namespace {

constexpr double kForever = 1e9;  // as in mailbox.cpp: longer timeouts wait forever

// The order in which instructions complete, across every loop of the process.
std::atomic<int64_t> sequence{0};

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes() << " " << t.scalar_type() << " on " << t.device();
  return s.str();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// StandInGraph

StandInGraph::StandInGraph(std::string name, std::vector<at::Tensor> inputs, std::vector<at::Tensor> outputs,
                           double scale, double shift, int64_t fail_at)
    : name_(std::move(name)), inputs_(std::move(inputs)), outputs_(std::move(outputs)), scale_(scale), shift_(shift),
      fail_at_(fail_at) {
  PIPECORE_CHECK(inputs_.size() == outputs_.size(), ErrorKind::kValue, "StandInGraph '", name_, "': ", inputs_.size(),
                 " inputs but ", outputs_.size(), " outputs; each output is computed from the input at its index");
  for (size_t i = 0; i < inputs_.size(); ++i) {
    PIPECORE_CHECK(inputs_[i].defined() && outputs_[i].defined(), ErrorKind::kValue, "StandInGraph '", name_,
                   "': tensor ", i, " is undefined");
    PIPECORE_CHECK(inputs_[i].sizes() == outputs_[i].sizes() && inputs_[i].scalar_type() == outputs_[i].scalar_type() &&
                       inputs_[i].device() == outputs_[i].device(),
                   ErrorKind::kValue, "StandInGraph '", name_, "': input ", i, " is ", shape_of(inputs_[i]),
                   " but output ", i, " is ", shape_of(outputs_[i]));
  }
}

void StandInGraph::replay() {
  const int64_t n = ++replays_;
  if (n == fail_at_) {
    throw std::runtime_error(describe() + ": replay " + std::to_string(n) + " failed (the stand-in was told to)");
  }
  for (size_t i = 0; i < inputs_.size(); ++i) outputs_[i].copy_(inputs_[i] * scale_ + shift_);
}

// ---------------------------------------------------------------------------------------------
// StageLoop

StageLoop::StageLoop(int64_t stage, std::vector<std::shared_ptr<Replayable>> graphs, std::vector<at::Tensor> buffers,
                     const std::vector<py::object>& mailboxes)
    : stage_(stage), graphs_(std::move(graphs)), buffers_(std::move(buffers)) {
  PIPECORE_CHECK(stage_ >= 0, ErrorKind::kValue, "StageLoop: stage must be >= 0, got ", stage_);
  for (size_t i = 0; i < graphs_.size(); ++i) {
    PIPECORE_CHECK(graphs_[i] != nullptr, ErrorKind::kValue, "StageLoop: stage ", stage_, ": graph ", i, " is None");
  }
  for (size_t i = 0; i < buffers_.size(); ++i) {
    PIPECORE_CHECK(buffers_[i].defined(), ErrorKind::kValue, "StageLoop: stage ", stage_, ": buffer ", i,
                   " is undefined");
  }
  for (size_t i = 0; i < mailboxes.size(); ++i) {
    PIPECORE_CHECK(py::isinstance<Mailbox>(mailboxes[i]), ErrorKind::kValue, "StageLoop: stage ", stage_,
                   ": mailbox ", i, " is a ", py::str(py::type::of(mailboxes[i])).cast<std::string>(),
                   ", not a pipecore._C.Mailbox");
  }
  for (const auto& m : mailboxes) {
    mailboxes_.push_back(m.cast<Mailbox*>());
    mailbox_refs_.push_back(m.inc_ref().ptr());
  }
}

StageLoop::~StageLoop() {
  if (thread_.joinable()) {
    if (running()) abort("stage " + std::to_string(stage_) + ": its StageLoop was destroyed while its program ran");
    // The loop's thread may need the GIL for a moment (dropping a tensor Python once held): wait without it.
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      thread_.join();
    } else {
      thread_.join();
    }
  }
  if (Py_IsInitialized() && !mailbox_refs_.empty()) {
    py::gil_scoped_acquire gil;
    for (PyObject* ref : mailbox_refs_) Py_DECREF(ref);
  }
}

std::string StageLoop::where(size_t index, const Instruction& ins) const {
  std::string what;
  switch (ins.kind) {
    case Instruction::Kind::kTake:
      what = "take key " + std::to_string(ins.key) + " from mailbox " + std::to_string(ins.target);
      break;
    case Instruction::Kind::kReplay:
      what = "replay " + graphs_[static_cast<size_t>(ins.target)]->describe();
      break;
    case Instruction::Kind::kPost:
      what = "post key " + std::to_string(ins.key) + " to mailbox " + std::to_string(ins.target);
      break;
  }
  return "stage " + std::to_string(stage_) + ", instruction " + std::to_string(index) + " (" + what + ")";
}

void StageLoop::start(std::vector<Instruction> program, double timeout) {
  PIPECORE_CHECK(!std::isnan(timeout), ErrorKind::kValue, "StageLoop.start: timeout must be a number of seconds "
                 "(negative = forever), got nan");
  const auto n_graphs = static_cast<int64_t>(graphs_.size());
  const auto n_buffers = static_cast<int64_t>(buffers_.size());
  const auto n_mailboxes = static_cast<int64_t>(mailboxes_.size());
  for (size_t i = 0; i < program.size(); ++i) {
    const Instruction& ins = program[i];
    if (ins.kind == Instruction::Kind::kReplay) {
      PIPECORE_CHECK(ins.target >= 0 && ins.target < n_graphs, ErrorKind::kValue, "StageLoop.start: stage ", stage_,
                     ", instruction ", i, ": graph ", ins.target, " is out of range for ", n_graphs, " graphs");
      continue;
    }
    PIPECORE_CHECK(ins.target >= 0 && ins.target < n_mailboxes, ErrorKind::kValue, "StageLoop.start: stage ", stage_,
                   ", instruction ", i, ": mailbox ", ins.target, " is out of range for ", n_mailboxes, " mailboxes");
    for (int64_t b : ins.buffers) {
      PIPECORE_CHECK(b >= 0 && b < n_buffers, ErrorKind::kValue, "StageLoop.start: stage ", stage_, ", instruction ",
                     i, ": buffer ", b, " is out of range for ", n_buffers, " buffers");
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  PIPECORE_CHECK(!started_, ErrorKind::kRuntime, "StageLoop.start: stage ", stage_,
                 done_ ? ": the previous program ended but was not joined; join() it first"
                       : ": a program is still running; join() it first");
  status_ = Status::ready();
  completed_.clear();
  // The caller's torch thread-local state (grad mode, autocast, profiler), entered on the loop's thread. The new
  // thread's finish() waits for mu_, held here, so setting the state after it starts is safe; a thread that
  // cannot be started (std::system_error, raised with the GIL held) leaves the loop as it was.
  thread_ = std::thread(&StageLoop::run, this, std::move(program), timeout, at::ThreadLocalState());
  started_ = true;
  done_ = false;
}

Status StageLoop::execute(const Instruction& ins, double timeout) {
  switch (ins.kind) {
    case Instruction::Kind::kTake: {
      std::vector<at::Tensor> message;
      Status status = mailboxes_[static_cast<size_t>(ins.target)]->take_tensors(ins.key, timeout, message);
      if (status.code != Status::Code::kReady) return status;
      if (message.size() != ins.buffers.size()) {
        return Status::failed("the message has " + std::to_string(message.size()) + " tensors, the graph's static " +
                              "inputs are " + std::to_string(ins.buffers.size()));
      }
      // Checked before anything is copied: a message that does not fit is never replayed on.
      for (size_t i = 0; i < message.size(); ++i) {
        const at::Tensor& buffer = buffers_[static_cast<size_t>(ins.buffers[i])];
        const at::Tensor& got = message[i];
        if (!got.defined() || got.sizes() != buffer.sizes() || got.scalar_type() != buffer.scalar_type() ||
            got.device() != buffer.device()) {
          return Status::failed("tensor " + std::to_string(i) + " of the message is " +
                                (got.defined() ? shape_of(got) : std::string("undefined")) +
                                ", the static buffer it goes to is " + shape_of(buffer) +
                                " (a new shape needs a new capture, or the eager path)");
        }
      }
      for (size_t i = 0; i < message.size(); ++i) buffers_[static_cast<size_t>(ins.buffers[i])].copy_(message[i]);
      return Status::ready();
    }
    case Instruction::Kind::kReplay:
      graphs_[static_cast<size_t>(ins.target)]->replay();
      return Status::ready();
    case Instruction::Kind::kPost: {
      std::vector<at::Tensor> message;
      message.reserve(ins.buffers.size());
      for (int64_t b : ins.buffers) message.push_back(buffers_[static_cast<size_t>(b)].clone());
      return mailboxes_[static_cast<size_t>(ins.target)]->put_tensors(ins.key, message);
    }
  }
  return Status::failed("unknown instruction");
}

void StageLoop::run(std::vector<Instruction> program, double timeout, at::ThreadLocalState state) {
  Status status = Status::ready();
  try {
    at::ThreadLocalStateGuard tls(state);
    at::init_num_threads();
    c10::AutoGradMode no_grad(false);  // static buffers are written in place, as a replay writes them
    const double wait = timeout < 0 || timeout > kForever ? -1.0 : timeout;
    for (size_t i = 0; i < program.size(); ++i) {
      Status s = Status::failed("");
      // A post's number is drawn before its message becomes visible, anything else's once it is done: so a take
      // always numbers after the post of the message it took.
      int64_t number = program[i].kind == Instruction::Kind::kPost ? sequence.fetch_add(1) + 1 : 0;
      try {
        s = execute(program[i], wait);
      } catch (abi::__forced_unwind&) {
        // The thread is being ended (dropping a tensor that needs the GIL after Python finalized ends it): let
        // it unwind, as without_gil does; swallowing the unwind would terminate the process.
        throw;
      } catch (const std::exception& e) {
        s = Status::failed(e.what());
      } catch (...) {
        s = Status::failed("unknown C++ exception");
      }
      if (s.code == Status::Code::kReady) {
        std::lock_guard<std::mutex> lock(mu_);
        completed_.emplace_back(static_cast<int64_t>(i), number ? number : sequence.fetch_add(1) + 1);
        continue;
      }
      // An abort keeps its reason (it names the stage that failed first); anything else is worded here.
      if (s.code != Status::Code::kAborted) s.message = where(i, program[i]) + ": " + s.message;
      status = s;
      break;
    }
  } catch (abi::__forced_unwind&) {
    throw;
  } catch (const std::exception& e) {
    status = Status::failed("stage " + std::to_string(stage_) + ": " + e.what());
  }
  // The stages waiting on this one stop too: a failure or an abort (with its first reason) reaches every mailbox
  // the loop uses, so a chain of loops stops from end to end.
  if (status.code != Status::Code::kReady) {
    for (Mailbox* m : mailboxes_) m->abort(status.message);
  }
  finish(std::move(status));
}

void StageLoop::finish(Status status) {
  std::lock_guard<std::mutex> lock(mu_);
  status_ = std::move(status);
  done_ = true;
  done_cv_.notify_all();
}

void StageLoop::join(double timeout) {
  PIPECORE_CHECK(!std::isnan(timeout), ErrorKind::kValue, "StageLoop.join: timeout must be a number of seconds "
                 "(negative = forever), got nan");
  {
    std::lock_guard<std::mutex> lock(mu_);
    PIPECORE_CHECK(started_, ErrorKind::kRuntime, "StageLoop.join: stage ", stage_, ": no program was started");
  }
  without_gil([&] {
    std::unique_lock<std::mutex> lock(mu_);
    auto ended = [&] { return done_; };
    if (timeout < 0 || timeout > kForever) {
      done_cv_.wait(lock, ended);
    } else if (!done_cv_.wait_for(lock, std::chrono::duration<double>(timeout), ended)) {
      return Status::timed_out("StageLoop.join: stage " + std::to_string(stage_) + " is still running its program (" +
                               std::to_string(completed_.size()) + " instructions done) after " +
                               std::to_string(timeout) + " s");
    }
    Status result = status_;
    started_ = false;
    std::thread ended_thread = std::move(thread_);  // one joiner takes it; the thread has finished its program
    lock.unlock();                                 // rule 5: no mutex held when the GIL comes back
    if (ended_thread.joinable()) ended_thread.join();
    return result;
  });
}

void StageLoop::abort(const std::string& reason) {
  for (Mailbox* m : mailboxes_) m->abort(reason);
}

bool StageLoop::running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !done_;
}

std::vector<std::pair<int64_t, int64_t>> StageLoop::completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_;
}

}  // namespace pipecore
