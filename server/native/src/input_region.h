// This front end's input region of the shared arena, and the allocator of its blocks.
//
// The arena (server/ipc/arena.py) is one memfd mapping shared by every process: each front end
// writes request inputs into its own region, the executor reads them in place and says when it
// is done (Result.released / ToFrontend.released). Only this process allocates here, so the
// lock is for its own threads: the gRPC workers allocate, the executor link's reader frees.
//
// The scheme is the Python ArenaAllocator's: best fit over a free list kept by address and by
// size, immediate coalescing of address neighbours, sizes rounded up to 256 bytes, and the
// block placed at the end of its hole next to the neighbour expected to be freed later (so the
// leftover merges with the hole the earlier one leaves). Every operation is O(log n) in the
// number of free blocks; nothing scans the live allocations.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

namespace batchgate {

// The shared arena mapped into this process.
class Arena {
 public:
  // Maps `bytes` of the memfd `fd` (MAP_SHARED, read and write); false with `error` set.
  bool Map(int fd, uint64_t bytes, std::string* error);
  ~Arena();

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  // Whether [offset, offset + nbytes) lies inside the arena.
  bool Contains(uint64_t offset, uint64_t nbytes) const {
    return offset <= size_ && nbytes <= size_ - offset;
  }

 private:
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

class InputRegion {
 public:
  static constexpr uint64_t kAlignment = 256;

  // The region [base, base + size) of the arena; both multiples of kAlignment.
  InputRegion(uint64_t base, uint64_t size);

  // The arena offset of a block of at least `nbytes` (at least one unit, for empty tensors
  // too), or nullopt when no free block fits.
  std::optional<uint64_t> Allocate(uint64_t nbytes);
  // Takes `nbytes` at exactly `offset`, as Allocate would have given them (Free returns them);
  // false, and nothing changed, when they are not all free. For blocks the executor still
  // reads that this process must not hand out (it restarted while a batch read its
  // predecessor's inputs).
  bool Reserve(uint64_t offset, uint64_t nbytes);
  // Returns a block Allocate gave; false (and nothing changed) for an offset that is not one.
  bool Free(uint64_t offset);

  uint64_t bytes_in_use() const { return in_use_.load(std::memory_order_relaxed); }
  uint64_t base() const { return base_; }
  uint64_t size() const { return size_; }

  // For tests: whether the free list and the allocations tile the region exactly, every free
  // block is coalesced and both indexes agree. O(n).
  bool CheckInvariants(std::string* problem) const;

 private:
  struct Block {
    uint64_t size;
    uint64_t serial;  // allocation order: the order blocks are expected to be freed in
  };

  bool UpperNeighbourOutlives(uint64_t start, uint64_t size) const;
  void AddFree(uint64_t start, uint64_t size);
  void RemoveFree(uint64_t start, uint64_t size);

  const uint64_t base_;
  const uint64_t size_;
  mutable std::mutex mu_;
  std::map<uint64_t, uint64_t> free_by_address_;            // start -> size
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;    // (size, start)
  std::unordered_map<uint64_t, Block> allocated_;          // start -> block
  std::unordered_map<uint64_t, uint64_t> allocation_ends_;  // end -> start
  uint64_t serial_ = 0;
  std::atomic<uint64_t> in_use_{0};
};

}  // namespace batchgate
