// The boundary between Python and pipecore's C++: errors, and the one helper that releases the GIL.
// The rules it implements are in csrc/README.md; every binding follows them.
#pragma once

#include <pybind11/pybind11.h>

#include <c10/util/StringUtil.h>
#include <cxxabi.h>

#include <exception>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace pipecore {

// Which Python exception a pipecore::Error becomes (bindings.cpp translates it, for this module only).
enum class ErrorKind { kValue, kIndex, kKey, kRuntime, kTimeout };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

// A wait ended because abort() was called; what() is the abort reason. Bound as pipecore._C.Aborted
// (a RuntimeError subclass).
class Aborted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
// With PIPECORE_CHECK_GIL (sanitizer builds), aborts with a message when a raise site runs without the
// GIL: that is a bug in pipecore, to be found by the tests rather than by users.
void assert_gil_held(const char* what);
}  // namespace detail

// Raises (throws) with the GIL held; see rule 1.
[[noreturn]] inline void raise(ErrorKind kind, const std::string& message) {
  detail::assert_gil_held(message.c_str());
  throw Error(kind, message);
}

}  // namespace pipecore

// raise(kind, concatenation of the message parts) unless cond holds. A macro, so that the parts (which
// may describe state at some cost) are evaluated only on failure.
#define PIPECORE_CHECK(cond, kind, ...)                              \
  do {                                                               \
    if (!(cond)) [[unlikely]] {                                      \
      ::pipecore::raise((kind), ::c10::str(__VA_ARGS__));            \
    }                                                                \
  } while (false)

namespace pipecore {

// How a GIL-released section ended: decided (and its message worded) without raising, raised by
// Status::raise_if_failed once the GIL is held again.
struct Status {
  enum class Code { kReady, kAborted, kTimedOut, kFailed };
  Code code = Code::kReady;
  std::string message;

  static Status ready() { return {}; }
  static Status aborted(std::string reason) { return {Code::kAborted, std::move(reason)}; }
  static Status timed_out(std::string message) { return {Code::kTimedOut, std::move(message)}; }
  static Status failed(std::string message) { return {Code::kFailed, std::move(message)}; }

  // GIL held: Aborted, TimeoutError or RuntimeError for a status other than ready.
  void raise_if_failed() const {
    switch (code) {
      case Code::kReady:
        return;
      case Code::kAborted:
        detail::assert_gil_held(message.c_str());
        throw Aborted(message);
      case Code::kTimedOut:
        raise(ErrorKind::kTimeout, message);
      case Code::kFailed:
        raise(ErrorKind::kRuntime, message);
    }
  }
};

// Releases the GIL, runs fn (which returns a Status, or nothing for "ready"), takes the GIL back, and
// only then raises what fn reported. Anything fn throws is caught before the GIL is re-acquired and
// raised as a RuntimeError afterwards. fn must not touch Python objects (rule 4) and must leave every
// mutex it took unlocked before it returns (rule 5).
template <class Fn>
void without_gil(Fn&& fn) {
  Status status;
  {
    pybind11::gil_scoped_release nogil;
    try {
      if constexpr (std::is_void_v<decltype(fn())>) {
        fn();
      } else {
        status = fn();
      }
    } catch (abi::__forced_unwind&) {
      throw;  // thread cancellation must unwind (the thread is ending; nothing is raised to Python)
    } catch (const std::exception& e) {
      status = Status::failed(e.what());
    } catch (...) {
      status = Status::failed("pipecore._C: unknown C++ exception in a GIL-released section");
    }
  }
  status.raise_if_failed();
}

}  // namespace pipecore
