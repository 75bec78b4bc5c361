// WeightRing: K versions of one pipeline stage's flat parameter buffer in a single allocation.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace pipecore {

// Slot life cycle (pins are counted separately and only on slots that hold a version):
//
//   free --acquire--> acquired --publish(v)--> live --publish(another slot)--> stale
//     ^                  |                                                      |
//     +----release-------+          stale with pin count 0 is free again <------+
//
// A free slot may still carry the version it last held (find() reports it) until acquire() reuses it.
// advance(v) relabels an unpinned live slot that was updated in place; rewind(v) undoes updates back to v.
class WeightRing {
 public:
  WeightRing(int64_t numel, int64_t num_slots, at::ScalarType dtype, at::Device device);

  // 1-D view of slot i; shares storage with the ring but has its own autograd version counter, so
  // writing one slot does not invalidate graphs that saved another slot's views.
  at::Tensor slot(int64_t i) const;
  // The whole allocation (num_slots * slot_stride elements; padding between slots is unused).
  const at::Tensor& buffer() const { return buffer_; }

  int64_t numel() const { return numel_; }
  int64_t num_slots() const { return static_cast<int64_t>(slots_.size()); }
  int64_t slot_stride() const { return stride_; }
  int64_t nbytes() const;

  std::optional<int64_t> live_slot() const;
  std::optional<int64_t> live_version() const;
  std::optional<int64_t> version_of(int64_t i) const;
  int64_t pin_count(int64_t i) const;
  bool is_acquired(int64_t i) const;
  std::optional<int64_t> find(int64_t version) const;
  // "free", "acquired", "live" or "stale" (not live, pinned).
  std::string state(int64_t i) const;

  int64_t acquire();
  void publish(int64_t i, int64_t version);
  // The live slot was updated in place (no reader holds the old values): it now holds `version`.
  void advance(int64_t version);
  void release(int64_t i);
  // Undo updates: every slot holding a version newer than `version` forgets it (none may be pinned or
  // acquired), and the slot still holding `version` becomes live again. Returns false, with no live slot,
  // when no slot holds it any more: then publish() it into an acquired slot.
  bool rewind(int64_t version);
  void pin(int64_t i);
  void unpin(int64_t i);

  std::string repr() const;

 private:
  struct Slot {
    at::Tensor view;
    int64_t version = -1;  // -1: holds no version
    int64_t pins = 0;
    bool acquired = false;
  };

  void check_index(const char* op, int64_t i) const;
  bool is_free(int64_t i) const;
  std::string describe(int64_t i) const;
  std::string state_detail(int64_t i) const;
  std::string in_use_summary() const;
  std::string repr_unlocked() const;

  int64_t numel_;
  int64_t stride_;
  at::Tensor buffer_;
  std::vector<Slot> slots_;
  int64_t live_ = -1;
  mutable std::mutex mu_;
};

}  // namespace pipecore
