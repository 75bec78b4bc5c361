#include "ring.h"

#include "boundary.h"

#include <sstream>

namespace pipecore {

namespace {
// Misuse of the ring's API is a ValueError (a bad argument) or a RuntimeError (a call the slot's state
// does not allow), raised with the GIL held: every method runs on the caller's thread (csrc/README.md).
#define PC_CHECK_VALUE(cond, ...) PIPECORE_CHECK(cond, ::pipecore::ErrorKind::kValue, __VA_ARGS__)
#define PC_CHECK_STATE(cond, ...) PIPECORE_CHECK(cond, ::pipecore::ErrorKind::kRuntime, __VA_ARGS__)

// Slot starts are aligned to 64 elements (256 B for fp32) so every slot is as aligned as the
// allocation itself and vector loads never straddle two slots.
constexpr int64_t kSlotAlign = 64;
}  // namespace

WeightRing::WeightRing(int64_t numel, int64_t num_slots, at::ScalarType dtype, at::Device device) {
  PC_CHECK_VALUE(numel > 0, "WeightRing: numel must be positive, got ", numel);
  PC_CHECK_VALUE(num_slots > 0, "WeightRing: num_slots must be positive, got ", num_slots);
  PC_CHECK_VALUE(at::isFloatingType(dtype), "WeightRing: dtype must be a floating type, got ", dtype);
  numel_ = numel;
  stride_ = (numel + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
  // Zero-filled so that unused slots and padding never hold NaN garbage.
  buffer_ = at::zeros({num_slots * stride_}, at::TensorOptions().dtype(dtype).device(device));
  slots_.resize(static_cast<size_t>(num_slots));
  for (int64_t i = 0; i < num_slots; ++i) {
    slots_[i].view = buffer_.narrow(0, i * stride_, numel).variable_data();
  }
}

void WeightRing::check_index(const char* op, int64_t i) const {
  PC_CHECK_VALUE(i >= 0 && i < num_slots(), "WeightRing.", op, ": slot index ", i,
                    " is out of range for a ring of ", num_slots(), " slots");
}

bool WeightRing::is_free(int64_t i) const {
  const Slot& s = slots_[i];
  return i != live_ && s.pins == 0 && !s.acquired;
}

// "slot 1 v3 x2": index, version (or "acquired"/"empty") and pin count when pinned.
std::string WeightRing::describe(int64_t i) const {
  const Slot& s = slots_[i];
  std::ostringstream o;
  o << "slot " << i;
  if (s.acquired) {
    o << " acquired";
  } else if (s.version >= 0) {
    o << " v" << s.version;
  } else {
    o << " empty";
  }
  if (s.pins > 0) o << " x" << s.pins;
  return o.str();
}

// "live, v6, 2 pins" / "free, still holds v3" / "acquired" ...
std::string WeightRing::state_detail(int64_t i) const {
  const Slot& s = slots_[i];
  std::ostringstream o;
  if (i == live_) o << "live, v" << s.version;
  else if (s.acquired) o << "acquired, not yet published";
  else if (s.pins > 0) o << "stale, v" << s.version;
  else if (s.version >= 0) o << "free, still holds v" << s.version;
  else o << "free, empty";
  if (s.pins > 0) o << ", " << s.pins << (s.pins == 1 ? " pin" : " pins");
  return o.str();
}

std::string WeightRing::in_use_summary() const {
  std::ostringstream o;
  o << "live: ";
  if (live_ >= 0) {
    const Slot& s = slots_[live_];
    o << "slot " << live_ << " v" << s.version;
    if (s.pins > 0) o << " x" << s.pins;
  } else {
    o << "none";
  }
  std::vector<std::string> pinned, acquired;
  for (int64_t i = 0; i < num_slots(); ++i) {
    if (i == live_) continue;
    if (slots_[i].acquired) acquired.push_back("slot " + std::to_string(i));
    else if (slots_[i].pins > 0) pinned.push_back(describe(i));
  }
  auto join = [](const std::vector<std::string>& parts) {
    std::string r;
    for (size_t k = 0; k < parts.size(); ++k) r += (k ? ", " : "") + parts[k];
    return r;
  };
  if (!pinned.empty()) o << "; pinned: " << join(pinned);
  if (!acquired.empty()) o << "; acquired, not yet published: " << join(acquired);
  return o.str();
}

at::Tensor WeightRing::slot(int64_t i) const {
  std::lock_guard<std::mutex> g(mu_);
  check_index("slot", i);
  return slots_[i].view;
}

int64_t WeightRing::nbytes() const { return static_cast<int64_t>(buffer_.nbytes()); }

std::optional<int64_t> WeightRing::live_slot() const {
  std::lock_guard<std::mutex> g(mu_);
  if (live_ < 0) return std::nullopt;
  return live_;
}

std::optional<int64_t> WeightRing::live_version() const {
  std::lock_guard<std::mutex> g(mu_);
  if (live_ < 0) return std::nullopt;
  return slots_[live_].version;
}

std::optional<int64_t> WeightRing::version_of(int64_t i) const {
  std::lock_guard<std::mutex> g(mu_);
  check_index("version_of", i);
  if (slots_[i].version < 0) return std::nullopt;
  return slots_[i].version;
}

int64_t WeightRing::pin_count(int64_t i) const {
  std::lock_guard<std::mutex> g(mu_);
  check_index("pin_count", i);
  return slots_[i].pins;
}

bool WeightRing::is_acquired(int64_t i) const {
  std::lock_guard<std::mutex> g(mu_);
  check_index("is_acquired", i);
  return slots_[i].acquired;
}

std::optional<int64_t> WeightRing::find(int64_t version) const {
  std::lock_guard<std::mutex> g(mu_);
  for (int64_t i = 0; i < num_slots(); ++i) {
    if (slots_[i].version == version && version >= 0) return i;
  }
  return std::nullopt;
}

std::string WeightRing::state(int64_t i) const {
  std::lock_guard<std::mutex> g(mu_);
  check_index("state", i);
  if (i == live_) return "live";
  if (slots_[i].acquired) return "acquired";
  if (slots_[i].pins > 0) return "stale";
  return "free";
}

int64_t WeightRing::acquire() {
  std::lock_guard<std::mutex> g(mu_);
  // Prefer a slot that never held a version, then the oldest version, so that find() keeps
  // recent versions available for as long as possible.
  int64_t best = -1;
  for (int64_t i = 0; i < num_slots(); ++i) {
    if (!is_free(i)) continue;
    if (best < 0 || slots_[i].version < slots_[best].version) best = i;
  }
  PC_CHECK_STATE(best >= 0, "WeightRing.acquire: all ", num_slots(), " slots are in use (", in_use_summary(),
              ")");
  slots_[best].acquired = true;
  slots_[best].version = -1;  // the old contents are about to be overwritten
  return best;
}

void WeightRing::publish(int64_t i, int64_t version) {
  std::lock_guard<std::mutex> g(mu_);
  check_index("publish", i);
  Slot& s = slots_[i];
  PC_CHECK_STATE(s.acquired, "WeightRing.publish: slot ", i, " was not acquired (it is ", state_detail(i),
              "); call acquire() and write the new weights into the slot it returns first");
  PC_CHECK_VALUE(version >= 0, "WeightRing.publish: version must be non-negative, got ", version);
  if (live_ >= 0) {
    PC_CHECK_VALUE(version > slots_[live_].version, "WeightRing.publish: version ", version,
                      " is not newer than the live version ", slots_[live_].version, " (slot ", live_, ")");
  }
  s.acquired = false;
  s.version = version;
  live_ = i;
}

void WeightRing::advance(int64_t version) {
  std::lock_guard<std::mutex> g(mu_);
  PC_CHECK_STATE(live_ >= 0, "WeightRing.advance: no live slot yet; publish() a first version");
  Slot& s = slots_[live_];
  PC_CHECK_STATE(s.pins == 0, "WeightRing.advance: the live slot ", live_, " is pinned (", describe(live_),
              "); its old values are still needed, so write the new version into an acquired slot instead");
  PC_CHECK_VALUE(version > s.version, "WeightRing.advance: version ", version,
                    " is not newer than the live version ", s.version, " (slot ", live_, ")");
  s.version = version;
}

void WeightRing::release(int64_t i) {
  std::lock_guard<std::mutex> g(mu_);
  check_index("release", i);
  PC_CHECK_STATE(slots_[i].acquired, "WeightRing.release: slot ", i, " is not acquired (it is ", state_detail(i),
              "); only a slot returned by acquire() and not yet published can be released");
  slots_[i].acquired = false;
  slots_[i].version = -1;
}

bool WeightRing::rewind(int64_t version) {
  std::lock_guard<std::mutex> g(mu_);
  PC_CHECK_VALUE(version >= 0, "WeightRing.rewind: version must be non-negative, got ", version);
  for (int64_t i = 0; i < num_slots(); ++i) {
    const Slot& s = slots_[i];
    PC_CHECK_STATE(!s.acquired, "WeightRing.rewind: slot ", i, " is acquired and not yet published; release() it first");
    PC_CHECK_STATE(s.version <= version || s.pins == 0, "WeightRing.rewind: slot ", i, " holds v", s.version,
                ", newer than v", version, ", and is pinned (", describe(i), "); unpin it first");
  }
  int64_t found = -1;
  for (int64_t i = 0; i < num_slots(); ++i) {
    Slot& s = slots_[i];
    if (s.version > version) s.version = -1;
    if (s.version == version) found = i;
  }
  live_ = found;
  return found >= 0;
}

void WeightRing::pin(int64_t i) {
  std::lock_guard<std::mutex> g(mu_);
  check_index("pin", i);
  const Slot& s = slots_[i];
  PC_CHECK_STATE(!s.acquired && s.version >= 0, "WeightRing.pin: slot ", i, " holds no version (it is ",
              state_detail(i), "); only published versions can be pinned");
  slots_[i].pins += 1;
}

void WeightRing::unpin(int64_t i) {
  std::lock_guard<std::mutex> g(mu_);
  check_index("unpin", i);
  PC_CHECK_STATE(slots_[i].pins > 0, "WeightRing.unpin: slot ", i, " is not pinned (it is ", state_detail(i),
              "); every unpin must match an earlier pin");
  slots_[i].pins -= 1;
}

namespace {
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return "torch.float64";
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    default: return std::string("torch.") + c10::toString(t);
  }
}
}  // namespace

std::string WeightRing::repr_unlocked() const {
  std::ostringstream o;
  o << "WeightRing(numel=" << numel_ << ", num_slots=" << num_slots() << ", dtype=" << dtype_name(buffer_.scalar_type())
    << ", device=" << buffer_.device() << ", live=";
  if (live_ >= 0) o << "slot " << live_ << " v" << slots_[live_].version;
  else o << "None";
  o << ")";
  for (int64_t i = 0; i < num_slots(); ++i) {
    o << "\n  slot " << i << ": " << state_detail(i);
  }
  return o.str();
}

std::string WeightRing::repr() const {
  std::lock_guard<std::mutex> g(mu_);
  return repr_unlocked();
}

}  // namespace pipecore
