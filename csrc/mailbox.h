// Mailbox and Progress: the synchronisation points between pipeline stage worker threads.
//
// Every blocking wait releases the GIL (through without_gil, csrc/README.md rule 1), so other stages keep
// running Python while one waits, and every wait that does not have to block returns without touching
// the GIL at all (releasing and reacquiring it can hand the interpreter to another thread). A wait
// never throws: it returns a Status decided under the mutex, raised once the GIL is back. Lock order:
// the GIL may be held when taking the mutex (the sections it guards never need the GIL), but the GIL is
// never (re)acquired while the mutex is held; that would deadlock against a thread holding the GIL in
// put()/set().
#pragma once

#include <ATen/core/Tensor.h>
#include <pybind11/pybind11.h>

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "boundary.h"

namespace pipecore {

// Shared abort flag: the first reason is kept until reset(), because later aborts are usually
// consequences of the first failure (one stage fails, the executor then stops the others).
class AbortState {
 protected:
  // Requires mu_ held and the GIL held: raises Aborted if aborted.
  void raise_if_aborted() const;
  // Requires mu_ held through `lock`; the GIL need not be held and nothing is raised. Waits, registered
  // under `topic` (a mailbox key, a counter index), until aborted (Status::aborted with the reason) or
  // ready() (Status::ready); after `timeout` seconds (negative = forever) returns Status::timed_out with
  // describe() (called with mu_ held) plus the seconds waited. Defined in mailbox.cpp, its only user.
  template <class Ready, class Describe>
  Status wait(std::unique_lock<std::mutex>& lock, int64_t topic, double timeout, Ready ready, Describe describe);
  // Requires mu_ held: wakes the waiters registered under `topic`, and only them. A wake-up for every
  // change would wake each stage thread at every message, for other stages' keys: with more stage
  // threads than cores those spurious wake-ups cost more than the messages themselves.
  void wake(int64_t topic);
  // Lock mu_ themselves; abort_all also wakes every waiter.
  void abort_all(std::string reason);
  void clear_abort();

  mutable std::mutex mu_;
  bool aborted_ = false;
  std::string reason_;

 private:
  // Who waits for what: each waiter's own condition variable (a local of its wait), guarded by mu_.
  std::multimap<int64_t, std::condition_variable*> waiters_;
};

// Thread-safe int64 -> Python object map whose take() blocks until the key is present.
//
// A key may instead hold a list of tensors with no Python object around it (a native message): the native
// stage loop (stage_loop.h) posts and takes those from threads that never hold the GIL, and Python may put
// and take them too (take() returns a list). The tensors leave the map under the mutex and are dropped only
// after it is unlocked: dropping the last reference to a tensor Python once held can take the GIL (rule 5).
class Mailbox : AbortState {
 public:
  Mailbox() = default;
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;
  ~Mailbox();

  // GIL held by the caller. Raises KeyError if the key is present.
  void put(int64_t key, pybind11::object value);
  // GIL held by the caller; released only while waiting. timeout in seconds, negative = forever.
  pybind11::object take(int64_t key, double timeout = -1.0);
  bool contains(int64_t key) const;
  size_t size() const;
  std::vector<int64_t> keys() const;  // sorted
  // Every take() from now on raises Aborted(reason), present key or not, until reset().
  void abort(std::string reason) { abort_all(std::move(reason)); }
  void reset() { clear_abort(); }  // the stored items stay
  void clear();  // GIL held by the caller: drops (decrefs) every stored item

  // Native messages. put_tensors_py: GIL held, raises KeyError if the key is present; stores detached aliases
  // of the tensors (a message carries values, not autograd history, and no Python object). put_tensors and
  // take_tensors: any thread, GIL neither needed nor touched, nothing raised: a present key (put), a key
  // holding a Python object (take), an abort or a timeout come back as the Status. put_tensors moves
  // from `tensors` only when it succeeds; take_tensors fills `out` only when it is ready.
  void put_tensors_py(int64_t key, std::vector<at::Tensor> tensors);
  Status put_tensors(int64_t key, std::vector<at::Tensor>& tensors);
  Status take_tensors(int64_t key, double timeout, std::vector<at::Tensor>& out);

 private:
  bool has(int64_t key) const { return items_.count(key) != 0 || tensors_.count(key) != 0; }  // mu_ held

  // Raw strong references, so that no refcount is touched while the GIL is released.
  std::map<int64_t, PyObject*> items_;
  std::map<int64_t, std::vector<at::Tensor>> tensors_;  // native messages; a key is in one map at most
};

// One counter per stage (e.g. actions executed), with waiting for a counter to reach a value.
class Progress : AbortState {
 public:
  explicit Progress(int64_t n);

  void set(int64_t i, int64_t value);
  int64_t get(int64_t i) const;
  // Returns once counter i >= value. GIL held by the caller; released only while waiting.
  void wait_at_least(int64_t i, int64_t value, double timeout = -1.0);
  int64_t size() const { return static_cast<int64_t>(counters_.size()); }
  // Every wait_at_least() from now on raises Aborted(reason), until reset().
  void abort(std::string reason) { abort_all(std::move(reason)); }
  void reset() { clear_abort(); }  // the counters keep their values

 private:
  size_t index(const char* op, int64_t i) const;  // raises IndexError when out of range

  std::vector<int64_t> counters_;  // guarded by mu_; the size never changes
};

}  // namespace pipecore
