#include "mailbox.h"

#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor

#include <algorithm>
#include <chrono>
#include <cmath>
#include <sstream>

namespace py = pybind11;

namespace pipecore {

namespace {

// Longer timeouts wait forever: converting them to steady_clock ticks (int64 ns) would overflow.
constexpr double kForever = 1e9;  // about 31 years

// Called with the GIL held, before any waiting: NaN would make the deadline undefined.
void check_timeout(const char* op, double timeout) {
  PIPECORE_CHECK(!std::isnan(timeout), ErrorKind::kValue, op, ": timeout must be a number of seconds (negative = forever), got nan");
}

std::string seconds(double timeout) {
  std::ostringstream s;
  s << timeout << " s";
  return s.str();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// AbortState

void AbortState::raise_if_aborted() const {
  if (aborted_) Status::aborted(reason_).raise_if_failed();
}

template <class Ready, class Describe>
Status AbortState::wait(std::unique_lock<std::mutex>& lock, int64_t topic, double timeout, Ready ready,
                        Describe describe) {
  auto done = [&] { return aborted_ || ready(); };
  std::condition_variable cv;
  auto registered = waiters_.emplace(topic, &cv);
  bool in_time = true;
  if (timeout < 0 || timeout > kForever) {
    cv.wait(lock, done);
  } else {
    in_time = cv.wait_for(lock, std::chrono::duration<double>(timeout), done);
  }
  waiters_.erase(registered);  // under mu_ again: no wake() reaches cv once this wait returns
  if (!in_time) return Status::timed_out(describe() + " (waited " + seconds(timeout) + ")");
  // Checked after the wait too: abort wins over a key or value that arrived at the same time.
  if (aborted_) return Status::aborted(reason_);
  return Status::ready();
}

void AbortState::wake(int64_t topic) {
  // Notified with mu_ held: a waiter's condition variable lives only while it is registered.
  auto [first, last] = waiters_.equal_range(topic);
  for (auto it = first; it != last; ++it) it->second->notify_one();
}

void AbortState::abort_all(std::string reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!aborted_) {
    aborted_ = true;
    reason_ = std::move(reason);
  }
  for (auto& waiter : waiters_) waiter.second->notify_one();
}

void AbortState::clear_abort() {
  std::lock_guard<std::mutex> lock(mu_);
  aborted_ = false;
  reason_.clear();
}

// ---------------------------------------------------------------------------------------------
// Mailbox

Mailbox::~Mailbox() {
  // At interpreter exit the objects may already be gone with the interpreter; leak them then.
  if (items_.empty() || !Py_IsInitialized()) return;
  py::gil_scoped_acquire gil;
  for (auto& kv : items_) Py_DECREF(kv.second);
}

void Mailbox::put(int64_t key, py::object value) {
  std::lock_guard<std::mutex> lock(mu_);
  PIPECORE_CHECK(!has(key), ErrorKind::kKey, "Mailbox.put: key ", key, " is already present");
  // The map now owns this reference; take() hands it back with reinterpret_steal.
  items_.emplace(key, value.release().ptr());
  wake(key);
}

namespace {

py::list to_list(std::vector<at::Tensor>&& tensors) {
  py::list out;
  for (auto& t : tensors) out.append(py::cast(std::move(t)));
  return out;
}

}  // namespace

py::object Mailbox::take(int64_t key, double timeout) {
  check_timeout("Mailbox.take", timeout);
  // The reference (or the tensors) leave the maps under the mutex and reach Python only with the GIL
  // held; a take that fails leaves the item where it is.
  PyObject* obj = nullptr;
  std::vector<at::Tensor> tensors;
  bool native = false;
  auto extract = [&] {  // mu_ held, has(key)
    if (auto it = items_.find(key); it != items_.end()) {
      obj = it->second;
      items_.erase(it);
    } else {
      auto nt = tensors_.find(key);
      tensors = std::move(nt->second);
      tensors_.erase(nt);
      native = true;
    }
  };
  // Fast path, GIL kept: the key is usually there already when the pipeline is not stalled.
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    raise_if_aborted();
    if (has(key)) {
      extract();
      found = true;
    }
  }
  if (!found) {
    without_gil([&] {
      // mu_ is unlocked when this lambda returns, before without_gil takes the GIL back (rule 5).
      std::unique_lock<std::mutex> lock(mu_);
      Status status = wait(
          lock, key, timeout, [&] { return has(key); },
          [&] { return "Mailbox.take: key " + std::to_string(key) + " was not put"; });
      if (status.code == Status::Code::kReady) extract();
      return status;
    });
  }
  if (native) return to_list(std::move(tensors));
  return py::reinterpret_steal<py::object>(obj);
}

void Mailbox::put_tensors_py(int64_t key, std::vector<at::Tensor> tensors) {
  // A native message holds detached aliases (same storage, new tensor objects that no Python object ever
  // wrapped), never the caller's tensors: when a loop thread drops the last reference to a tensor Python once
  // held, torch takes the GIL to free its Python object, which would stall the loop behind Python, and while
  // the interpreter finalizes ends the thread inside a destructor, which terminates the process.
  for (auto& t : tensors) {
    if (t.defined()) t = t.detach();
  }
  Status status = put_tensors(key, tensors);
  PIPECORE_CHECK(status.code == Status::Code::kReady, ErrorKind::kKey, status.message);
}

Status Mailbox::put_tensors(int64_t key, std::vector<at::Tensor>& tensors) {
  std::lock_guard<std::mutex> lock(mu_);
  if (has(key)) return Status::failed("Mailbox.put_tensors: key " + std::to_string(key) + " is already present");
  tensors_.emplace(key, std::move(tensors));
  wake(key);
  return Status::ready();
}

Status Mailbox::take_tensors(int64_t key, double timeout, std::vector<at::Tensor>& out) {
  if (std::isnan(timeout)) return Status::failed("Mailbox.take_tensors: timeout is nan");
  std::unique_lock<std::mutex> lock(mu_);
  Status status = Status::ready();
  if (aborted_) return Status::aborted(reason_);
  if (!has(key)) {
    status = wait(
        lock, key, timeout, [&] { return has(key); },
        [&] { return "Mailbox.take_tensors: key " + std::to_string(key) + " was not put"; });
    if (status.code != Status::Code::kReady) return status;
  }
  auto it = tensors_.find(key);
  if (it == tensors_.end()) {
    return Status::failed("Mailbox.take_tensors: key " + std::to_string(key) +
                          " holds a Python object, not tensors put by put_tensors");
  }
  out = std::move(it->second);  // the caller drops them, after this returns and mu_ is unlocked
  tensors_.erase(it);
  return status;
}

bool Mailbox::contains(int64_t key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return has(key);
}

size_t Mailbox::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return items_.size() + tensors_.size();
}

std::vector<int64_t> Mailbox::keys() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  out.reserve(items_.size() + tensors_.size());
  for (const auto& kv : items_) out.push_back(kv.first);
  for (const auto& kv : tensors_) out.push_back(kv.first);
  std::sort(out.begin(), out.end());
  return out;
}

void Mailbox::clear() {
  std::map<int64_t, PyObject*> dropped;
  std::map<int64_t, std::vector<at::Tensor>> dropped_tensors;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped.swap(items_);
    dropped_tensors.swap(tensors_);
  }
  // Outside the lock: a decref can run arbitrary Python (__del__), which may use this mailbox.
  for (auto& kv : dropped) Py_DECREF(kv.second);
}

// ---------------------------------------------------------------------------------------------
// Progress

Progress::Progress(int64_t n) {
  PIPECORE_CHECK(n >= 1, ErrorKind::kValue, "Progress: need at least one counter, got n=", n);
  counters_.assign(static_cast<size_t>(n), 0);
}

size_t Progress::index(const char* op, int64_t i) const {
  PIPECORE_CHECK(i >= 0 && i < size(), ErrorKind::kIndex, "Progress.", op, ": counter index ", i, " is out of range for ",
        size(), " counters");
  return static_cast<size_t>(i);
}

void Progress::set(int64_t i, int64_t value) {
  size_t k = index("set", i);
  std::lock_guard<std::mutex> lock(mu_);
  counters_[k] = value;
  wake(i);
}

int64_t Progress::get(int64_t i) const {
  size_t k = index("get", i);
  std::lock_guard<std::mutex> lock(mu_);
  return counters_[k];
}

void Progress::wait_at_least(int64_t i, int64_t value, double timeout) {
  size_t k = index("wait_at_least", i);
  check_timeout("Progress.wait_at_least", timeout);
  {
    std::lock_guard<std::mutex> lock(mu_);
    raise_if_aborted();
    if (counters_[k] >= value) return;  // fast path, GIL kept
  }
  without_gil([&] {
    std::unique_lock<std::mutex> lock(mu_);  // unlocked before the GIL is taken back: see Mailbox::take
    return wait(
        lock, i, timeout, [&] { return counters_[k] >= value; },
        [&] {
          return "Progress.wait_at_least: counter " + std::to_string(i) + " is " + std::to_string(counters_[k]) +
                 ", not yet >= " + std::to_string(value);
        });
  });
}

}  // namespace pipecore
