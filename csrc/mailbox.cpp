#include "mailbox.h"

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
  if (std::isnan(timeout)) {
    throw py::value_error(std::string(op) + ": timeout must be a number of seconds (negative = forever), got nan");
  }
}

std::string seconds(double timeout) {
  std::ostringstream s;
  s << timeout << " s";
  return s.str();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// AbortState

void AbortState::throw_if_aborted() const {
  if (aborted_) throw Aborted(reason_);
}

template <class Ready, class Describe>
void AbortState::wait(std::unique_lock<std::mutex>& lock, double timeout, Ready ready, Describe describe) {
  auto done = [&] { return aborted_ || ready(); };
  if (timeout < 0 || timeout > kForever) {
    cv_.wait(lock, done);
  } else if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout), done)) {
    throw WaitTimeout(describe() + " (waited " + seconds(timeout) + ")");
  }
  // Checked after the wait too: abort wins over a key or value that arrived at the same time.
  throw_if_aborted();
}

void AbortState::abort_all(std::string reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_) {
      aborted_ = true;
      reason_ = std::move(reason);
    }
  }
  cv_.notify_all();
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, inserted] = items_.try_emplace(key, nullptr);
    if (!inserted) {
      throw py::key_error("Mailbox.put: key " + std::to_string(key) + " is already present");
    }
    // The map now owns this reference; take() hands it back with reinterpret_steal.
    it->second = value.release().ptr();
  }
  cv_.notify_all();
}

py::object Mailbox::take(int64_t key, double timeout) {
  check_timeout("Mailbox.take", timeout);
  // Fast path, GIL kept: the key is usually there already when the pipeline is not stalled.
  {
    std::lock_guard<std::mutex> lock(mu_);
    throw_if_aborted();
    auto it = items_.find(key);
    if (it != items_.end()) {
      PyObject* obj = it->second;
      items_.erase(it);
      return py::reinterpret_steal<py::object>(obj);
    }
  }
  PyObject* obj = nullptr;
  {
    py::gil_scoped_release nogil;
    // Declared after `nogil`, so mu_ is unlocked before the GIL is reacquired, also when wait()
    // throws: holding mu_ while waiting for the GIL would deadlock against a put() that holds
    // the GIL and waits for mu_.
    std::unique_lock<std::mutex> lock(mu_);
    wait(
        lock, timeout, [&] { return items_.count(key) != 0; },
        [&] { return "Mailbox.take: key " + std::to_string(key) + " was not put"; });
    auto it = items_.find(key);
    obj = it->second;
    items_.erase(it);
  }
  return py::reinterpret_steal<py::object>(obj);
}

bool Mailbox::contains(int64_t key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return items_.count(key) != 0;
}

size_t Mailbox::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return items_.size();
}

std::vector<int64_t> Mailbox::keys() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  out.reserve(items_.size());
  for (const auto& kv : items_) out.push_back(kv.first);  // std::map: already sorted
  return out;
}

void Mailbox::clear() {
  std::map<int64_t, PyObject*> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped.swap(items_);
  }
  // Outside the lock: a decref can run arbitrary Python (__del__), which may use this mailbox.
  for (auto& kv : dropped) Py_DECREF(kv.second);
}

// ---------------------------------------------------------------------------------------------
// Progress

Progress::Progress(int64_t n) {
  if (n < 1) throw py::value_error("Progress: need at least one counter, got n=" + std::to_string(n));
  counters_.assign(static_cast<size_t>(n), 0);
}

size_t Progress::index(const char* op, int64_t i) const {
  if (i < 0 || i >= size()) {
    throw py::index_error(std::string("Progress.") + op + ": counter index " + std::to_string(i) +
                          " is out of range for " + std::to_string(size()) + " counters");
  }
  return static_cast<size_t>(i);
}

void Progress::set(int64_t i, int64_t value) {
  size_t k = index("set", i);
  {
    std::lock_guard<std::mutex> lock(mu_);
    counters_[k] = value;
  }
  cv_.notify_all();
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
    throw_if_aborted();
    if (counters_[k] >= value) return;  // fast path, GIL kept
  }
  py::gil_scoped_release nogil;
  std::unique_lock<std::mutex> lock(mu_);  // after `nogil`: see Mailbox::take
  wait(
      lock, timeout, [&] { return counters_[k] >= value; },
      [&] {
        return "Progress.wait_at_least: counter " + std::to_string(i) + " is " + std::to_string(counters_[k]) +
               ", not yet >= " + std::to_string(value);
      });
}

}  // namespace pipecore
