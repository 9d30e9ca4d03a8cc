// partita's caching host allocator: torch's CPU allocator for large blocks, reusing freed ones.
//
// Why: every training step allocates and frees the same large host buffers (activations,
// logits, their gradients). glibc serves blocks above its mmap threshold with fresh mappings, so
// each step page-faults and zeroes all of them again (a 23M-parameter GPT-2 step on 2 CPU ranks:
// 140k-190k faults, 10-15% of the step). Serving them from the heap instead avoids the faults
// but fragments it (RSS grew 350 MB over the first steps). Like the CUDA caching allocator, this
// keeps freed blocks and hands them out again for requests of (nearly) the same size, which is
// what a repeating training step asks for.
//
// Bound: a request that no idle block fits maps a new block, but first unmaps idle blocks
// while the mapped total would pass (1 + headroom) x the peak of requested bytes (what tensors
// asked for, before rounding). Victims are the most recently freed blocks: in a repeating step
// those are needed again last. A block serves requests up to 1/8 smaller than itself; when no
// idle block is left and the total would still pass the limit, the unused page-aligned tails
// of blocks in use are unmapped too (the tensor never touches bytes past its request), so the
// mapped total stays within max((1 + headroom) x peak requested, the live requests rounded up
// to pages): within 1.05x for the default headroom, as blocks are at least 1 MiB (rounding
// adds < 0.4%). Without that trim, 8 MiB blocks serving 7.2 MiB requests plus new 1.2 MiB
// ones reached 1.096x. Also tried: letting a block up to twice the request serve it near the
// limit; the mapped total then exceeded the bound by the unused halves (a ZeRO-3 run: +45 MB
// RSS), so blocks serve only requests of about their size.
//
// Blocks below `min_bytes` go to the allocator that was installed before (torch's default).
// Built and loaded by partita/platform/host_cache.py; the C entry points below are its ctypes
// interface.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>

namespace {

constexpr size_t kPage = 4096;

size_t round_to_page(size_t n) { return (n + kPage - 1) / kPage * kPage; }

struct Block {
  size_t size;       // mapped bytes
  size_t requested;  // bytes the tensor using it asked for (0 while idle)
};

struct Stats {
  uint64_t live_bytes = 0;       // mapped bytes of blocks in use
  uint64_t idle_bytes = 0;       // mapped, cached for reuse
  uint64_t peak_mapped = 0;      // max of live + idle
  uint64_t requested_bytes = 0;  // bytes asked for by the tensors using blocks (<= live)
  uint64_t peak_requested = 0;   // max of requested_bytes
  uint64_t hits = 0;             // requests served from the cache
  uint64_t misses = 0;           // requests that mapped a new block
  uint64_t released = 0;         // bytes unmapped to make room or on empty_cache
  uint64_t slack = 0;            // bytes of blocks in use past their page-rounded requests
};

// Idle blocks by size; each remembers when it was freed.
using IdleMap = std::multimap<size_t, std::pair<void*, uint64_t>>;

class HostCache final : public c10::Allocator {
 public:
  HostCache(c10::Allocator* fallback, size_t min_bytes, double headroom)
      : fallback_(fallback),
        fallback_deleter_(fallback->raw_deleter()),
        min_bytes_(min_bytes),
        headroom_(headroom) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < min_bytes_) {
      return fallback_->allocate(n);
    }
    void* p = take(round_to_page(n), n);
    return {p, p, &HostCache::free_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &HostCache::free_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Unmaps every idle block.
  void empty() {
    std::lock_guard<std::mutex> lock(mu_);
    while (!idle_.empty()) {
      release_one(idle_.begin());
    }
  }

  Stats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  // fork(): the child must not inherit a mutex held by another thread.
  void lock() { mu_.lock(); }
  void unlock() { mu_.unlock(); }

  static HostCache* instance;

 private:
  static void free_block(void* p) {
    if (p != nullptr && !instance->give_back(p)) {
      // raw_allocate() of a small block came from the fallback allocator.
      instance->fallback_deleter_(p);
    }
  }

  // `size`: page-rounded bytes to hand out; `requested`: what the tensor asked for.
  void* take(size_t size, size_t requested) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.requested_bytes += requested;
    if (stats_.requested_bytes > stats_.peak_requested) {
      stats_.peak_requested = stats_.requested_bytes;
    }
    const double limit = static_cast<double>(stats_.peak_requested) * (1.0 + headroom_);
    // Reuse the smallest idle block that is at least `size` and at most 1/8 larger.
    auto it = idle_.lower_bound(size);
    if (it != idle_.end() && it->first <= size + size / 8) {
      stats_.hits += 1;
      return hand_out(it, requested);
    }
    // Miss: unmap idle blocks, most recently freed first, while mapping `size` more would
    // pass the limit; then the unused tails of blocks in use.
    while (!idle_.empty() && over(size, limit)) {
      release_one(recent_.rbegin()->second);
    }
    if (stats_.slack > 0 && over(size, limit)) {
      trim_live(size, limit);
    }
    void* p = map(size);
    if (p == nullptr) {
      while (!idle_.empty()) {
        release_one(idle_.begin());
      }
      p = map(size);
    }
    if (p == nullptr) {
      stats_.requested_bytes -= requested;
      TORCH_CHECK_WITH(OutOfMemoryError, false, "partita host cache: could not map ", size,
                       " bytes (", stats_.live_bytes, " bytes in use)");
    }
    blocks_[p] = Block{size, requested};
    stats_.live_bytes += size;
    stats_.misses += 1;
    stats_.peak_mapped = std::max(stats_.peak_mapped, stats_.live_bytes + stats_.idle_bytes);
    return p;
  }

  bool over(size_t size, double limit) const {
    return static_cast<double>(stats_.live_bytes + stats_.idle_bytes + size) > limit;
  }

  // Unmaps the tails of blocks in use past their page-rounded requests until mapping `size`
  // more stays within `limit` (or no tail is left).
  void trim_live(size_t size, double limit) {
    for (auto& [p, block] : blocks_) {
      const size_t keep = round_to_page(block.requested);
      if (block.requested == 0 || block.size <= keep) {
        continue;
      }
      const size_t tail = block.size - keep;
      munmap(static_cast<char*>(p) + keep, tail);
      block.size = keep;
      stats_.live_bytes -= tail;
      stats_.slack -= tail;
      stats_.released += tail;
      if (!over(size, limit)) {
        return;
      }
    }
  }

  void* hand_out(IdleMap::iterator it, size_t requested) {
    void* p = it->second.first;
    size_t size = it->first;
    recent_.erase(it->second.second);
    idle_.erase(it);
    blocks_[p].requested = requested;
    stats_.idle_bytes -= size;
    stats_.live_bytes += size;
    stats_.slack += size - round_to_page(requested);
    return p;
  }

  bool give_back(void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = blocks_.find(p);
    if (it == blocks_.end()) {
      return false;
    }
    uint64_t seq = ++freed_seq_;
    recent_.emplace(seq, idle_.emplace(it->second.size, std::make_pair(p, seq)));
    stats_.live_bytes -= it->second.size;
    stats_.slack -= it->second.size - round_to_page(it->second.requested);
    stats_.requested_bytes -= it->second.requested;
    stats_.idle_bytes += it->second.size;
    it->second.requested = 0;
    return true;
  }

  void release_one(IdleMap::iterator it) {
    size_t size = it->first;
    munmap(it->second.first, size);
    blocks_.erase(it->second.first);
    recent_.erase(it->second.second);
    idle_.erase(it);
    stats_.idle_bytes -= size;
    stats_.released += size;
  }

  static void* map(size_t size) {
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? nullptr : p;
  }

  c10::Allocator* fallback_;
  c10::DeleterFnPtr fallback_deleter_;
  size_t min_bytes_;
  double headroom_;
  std::mutex mu_;
  IdleMap idle_;                                  // size -> (idle block, when it was freed)
  std::map<uint64_t, IdleMap::iterator> recent_;  // when freed -> entry of idle_
  uint64_t freed_seq_ = 0;
  std::unordered_map<void*, Block> blocks_;       // every mapped block, live or idle
  Stats stats_;
};

HostCache* HostCache::instance = nullptr;

void before_fork() { HostCache::instance->lock(); }
void after_fork() { HostCache::instance->unlock(); }

}  // namespace

extern "C" {

// Installs the cache as torch's CPU allocator (once per process). Returns 1 when installed by
// this call, 0 when it already was.
int partita_host_cache_install(uint64_t min_bytes, double headroom) {
  if (HostCache::instance != nullptr) {
    return 0;
  }
  // Never destroyed: tensors may be freed during interpreter teardown.
  HostCache::instance =
      new HostCache(c10::GetCPUAllocator(), static_cast<size_t>(min_bytes), headroom);
  pthread_atfork(&before_fork, &after_fork, &after_fork);
  c10::SetCPUAllocator(HostCache::instance, /*priority=*/1);
  return 1;
}

// live, idle, peak mapped, hits, misses, released, requested, peak requested, into out[0..7].
void partita_host_cache_stats(uint64_t* out) {
  Stats s = HostCache::instance ? HostCache::instance->stats() : Stats{};
  out[0] = s.live_bytes;
  out[1] = s.idle_bytes;
  out[2] = s.peak_mapped;
  out[3] = s.hits;
  out[4] = s.misses;
  out[5] = s.released;
  out[6] = s.requested_bytes;
  out[7] = s.peak_requested;
}

void partita_host_cache_empty() {
  if (HostCache::instance != nullptr) {
    HostCache::instance->empty();
  }
}

}  // extern "C"
