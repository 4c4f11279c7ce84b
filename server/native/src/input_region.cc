#include "input_region.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <limits>
#include <vector>

namespace batchgate {

bool Arena::Map(int fd, uint64_t bytes, std::string* error) {
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    *error = "arena_fd " + std::to_string(fd) + " is not an open descriptor: " + std::strerror(errno);
    return false;
  }
  if (static_cast<uint64_t>(st.st_size) < bytes) {
    // Mapping past the end of the file would SIGBUS on first touch, not fail here.
    *error = "arena_fd " + std::to_string(fd) + " holds " + std::to_string(st.st_size) +
             " bytes, fewer than arena_bytes " + std::to_string(bytes);
    return false;
  }
  void* mapped = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mapped == MAP_FAILED) {
    *error = std::string("could not map the arena: ") + std::strerror(errno);
    return false;
  }
  data_ = static_cast<uint8_t*>(mapped);
  size_ = bytes;
  return true;
}

Arena::~Arena() {
  if (data_ != nullptr) munmap(data_, size_);
}

InputRegion::InputRegion(uint64_t base, uint64_t size) : base_(base), size_(size) {
  AddFree(base, size);
}

std::optional<uint64_t> InputRegion::Allocate(uint64_t nbytes) {
  if (nbytes > size_) return std::nullopt;
  const uint64_t need = nbytes == 0 ? kAlignment : (nbytes + kAlignment - 1) / kAlignment * kAlignment;
  std::lock_guard<std::mutex> lock(mu_);
  const auto best = free_by_size_.lower_bound({need, 0});
  if (best == free_by_size_.end()) return std::nullopt;
  const uint64_t hole_size = best->first;
  const uint64_t start = best->second;
  const uint64_t offset = UpperNeighbourOutlives(start, hole_size) ? start + hole_size - need : start;
  RemoveFree(start, hole_size);
  if (offset > start) AddFree(start, offset - start);
  if (offset + need < start + hole_size) AddFree(offset + need, start + hole_size - offset - need);
  allocated_.emplace(offset, Block{need, ++serial_});
  allocation_ends_.emplace(offset + need, offset);
  in_use_.fetch_add(need, std::memory_order_relaxed);
  return offset;
}

bool InputRegion::Reserve(uint64_t offset, uint64_t nbytes) {
  if (nbytes > size_ || offset % kAlignment != 0 || offset < base_) return false;
  const uint64_t need = nbytes == 0 ? kAlignment : (nbytes + kAlignment - 1) / kAlignment * kAlignment;
  if (offset - base_ > size_ - need) return false;
  std::lock_guard<std::mutex> lock(mu_);
  auto hole = free_by_address_.upper_bound(offset);
  if (hole == free_by_address_.begin()) return false;
  --hole;
  const uint64_t start = hole->first;
  const uint64_t hole_size = hole->second;
  if (offset + need > start + hole_size) return false;
  RemoveFree(start, hole_size);
  if (offset > start) AddFree(start, offset - start);
  if (offset + need < start + hole_size) AddFree(offset + need, start + hole_size - offset - need);
  allocated_.emplace(offset, Block{need, ++serial_});
  allocation_ends_.emplace(offset + need, offset);
  in_use_.fetch_add(need, std::memory_order_relaxed);
  return true;
}

bool InputRegion::Free(uint64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = allocated_.find(offset);
  if (it == allocated_.end()) return false;
  uint64_t start = offset;
  uint64_t size = it->second.size;
  allocated_.erase(it);
  allocation_ends_.erase(offset + size);
  in_use_.fetch_sub(size, std::memory_order_relaxed);
  auto after = free_by_address_.lower_bound(start);
  if (after != free_by_address_.begin()) {
    const auto before = std::prev(after);
    if (before->first + before->second == start) {
      start = before->first;
      size += before->second;
      RemoveFree(before->first, before->second);
    }
  }
  after = free_by_address_.find(start + size);
  if (after != free_by_address_.end()) {
    const uint64_t extra = after->second;
    RemoveFree(after->first, extra);
    size += extra;
  }
  AddFree(start, size);
  return true;
}

bool InputRegion::UpperNeighbourOutlives(uint64_t start, uint64_t size) const {
  // A region end counts as never freed. Coalescing keeps every hole between two allocations or
  // region ends, so both lookups hit. Two region ends (an empty region): the block goes low.
  constexpr uint64_t kRegionEnd = std::numeric_limits<uint64_t>::max();
  const uint64_t end = start + size;
  const uint64_t below =
      start == base_ ? kRegionEnd : allocated_.at(allocation_ends_.at(start)).serial;
  const uint64_t above = end == base_ + size_ ? kRegionEnd : allocated_.at(end).serial;
  return above > below;
}

void InputRegion::AddFree(uint64_t start, uint64_t size) {
  free_by_address_.emplace(start, size);
  free_by_size_.emplace(size, start);
}

void InputRegion::RemoveFree(uint64_t start, uint64_t size) {
  free_by_address_.erase(start);
  free_by_size_.erase({size, start});
}

bool InputRegion::CheckInvariants(std::string* problem) const {
  std::lock_guard<std::mutex> lock(mu_);
  struct Piece {
    uint64_t start, size;
    bool free;
  };
  std::vector<Piece> pieces;
  for (const auto& [start, size] : free_by_address_) {
    if (!free_by_size_.count({size, start})) {
      *problem = "free block " + std::to_string(start) + " missing from the size index";
      return false;
    }
    pieces.push_back({start, size, true});
  }
  if (free_by_size_.size() != free_by_address_.size()) {
    *problem = "the size index holds blocks the address index does not";
    return false;
  }
  uint64_t used = 0;
  for (const auto& [start, block] : allocated_) {
    if (start % kAlignment || block.size % kAlignment || block.size == 0) {
      *problem = "allocation " + std::to_string(start) + " is not aligned";
      return false;
    }
    const auto end = allocation_ends_.find(start + block.size);
    if (end == allocation_ends_.end() || end->second != start) {
      *problem = "allocation " + std::to_string(start) + " missing from the end index";
      return false;
    }
    used += block.size;
    pieces.push_back({start, block.size, false});
  }
  if (used != in_use_.load() || allocation_ends_.size() != allocated_.size()) {
    *problem = "bytes in use out of step";
    return false;
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& a, const Piece& b) { return a.start < b.start; });
  uint64_t position = base_;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (pieces[i].start != position) {
      *problem = "gap or overlap at " + std::to_string(position);
      return false;
    }
    if (i > 0 && pieces[i].free && pieces[i - 1].free) {
      *problem = "adjacent free blocks at " + std::to_string(pieces[i].start);
      return false;
    }
    position += pieces[i].size;
  }
  if (position != base_ + size_) {
    *problem = "the blocks do not reach the region's end";
    return false;
  }
  return true;
}

}  // namespace batchgate
