// offload/device_slot_cache.cu: the slot table on the GPU (see device_slot_cache.h): the plan
// kernel (one warp: hits, least-recently-used victims, pointer tables, the copy list), the copy
// kernel (pinned host memory read by SMs into the slots), and the source around them.
#include "offload/device_slot_cache.h"

#include <stdexcept>
#include <string>

#include "core/cuda_check.h"      // CUDA_CHECK
#include "core/elementwise.h"     // fill_nan
#include "offload/cache_policy.h"  // minimum_cache_slots, check_cache_size

namespace moe::cuda {

namespace {

// counters_ columns, per block (BlockOffloadStatistics' names)
enum Counter : int {
  kAcquires,
  kHits,
  kMisses,
  kPrefetched,
  kPrefetchedUsed,
  kPrefetchDropped,
  kBytesCopied,
  kCounters
};

constexpr int kMaxExperts = 1024;  // E of one plan (the router allows fewer)
constexpr int kCopyThreads = 256;

struct PlanArgs {
  const int32_t* top = nullptr;  // [count] the block's routing; nullptr: every expert
  int64_t count = 0;
  int64_t block = 0, experts = 0, slots = 0;
  bool prefetch = false;
  int32_t* slot_of = nullptr;         // [blocks * E]
  int32_t* expert_in_slot = nullptr;  // [C]
  int64_t* stamp = nullptr;           // [C]
  int32_t* prefetched = nullptr;      // [C]
  int64_t* clock = nullptr;           // [1]
  int32_t* copies = nullptr;          // [1 + 2E]: count, then (expert id, slot) pairs
  int64_t* counters = nullptr;        // [kCounters] this block's
  const bf16** tables = nullptr;      // [2, E] this block's (acquire)
  const bf16* slot_memory = nullptr;
  const bf16* poison = nullptr;
  int64_t expert_elements = 0, w1_elements = 0, expert_bytes = 0;
};

__device__ inline int warp_sum(int value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// One warp. A plan is a chain of small dependent reads and writes, and it sits on the compute
// stream between a block's gate and its experts, so it should wait for memory as few times as it
// can: the warp first reads together everything that does not depend on another read (the routing,
// the block's row of the slot table, the clock) into shared memory and registers; then every lane
// stamps its hits at once, and only a miss waits for memory again (its victim search and the
// victim's old expert). Lane 0 keeps the books of the misses, in ascending expert order. (Reading
// the table entry by entry on lane 0, a plan took 9.0 us on an H200; this way 7.9 us:
// offload_bench --kernel-trace, Switch-like batch 1, 2026-11-30.)
__global__ void plan_kernel(PlanArgs a) {
  __shared__ unsigned char needed[kMaxExperts];
  __shared__ int32_t slot_of[kMaxExperts];  // this block's row of the table: its experts' slots, -1 none
  const int lane = threadIdx.x;
  const int E = static_cast<int>(a.experts), C = static_cast<int>(a.slots);
  int32_t* const block_slots = a.slot_of + a.block * a.experts;

  // ---- the reads that depend on nothing, together ----
  for (int e = lane; e < E; e += 32) needed[e] = a.top == nullptr ? 1 : 0;
  __syncwarp();
#pragma unroll 4
  for (int e = lane; e < E; e += 32) slot_of[e] = block_slots[e];
  if (a.top != nullptr) {
    for (int64_t i = lane; i < a.count; i += 32) {
      const int32_t e = a.top[i];
      if (e >= 0 && e < E) needed[e] = 1;  // several lanes may write the same 1
    }
  }
  const int64_t now = *a.clock + (a.prefetch ? 0 : 1);
  __syncwarp();

  // ---- hits: stamped with the current time, so that no miss below evicts them ----
  int hits = 0, used = 0;
  for (int e = lane; e < E; e += 32) {
    const int32_t s = needed[e] ? slot_of[e] : -1;
    if (s < 0) continue;
    a.stamp[s] = now;  // distinct experts hold distinct slots: no two lanes write one stamp
    if (!a.prefetch) {
      ++hits;
      if (a.prefetched[s] != 0) ++used, a.prefetched[s] = 0;
    }
  }
  hits = warp_sum(hits);
  used = warp_sum(used);
  if (lane == 0 && !a.prefetch) *a.clock = now;
  __syncwarp();  // the stamps are written before any lane searches them

  // ---- misses in ascending expert order: the slot of smallest (stamp, index) stamped before now ----
  int listed = 0, dropped = 0;
  for (int e = 0; e < E; ++e) {
    if (!needed[e] || slot_of[e] >= 0) continue;  // every lane reads the same values
    int64_t best_stamp = INT64_MAX;
    int best = C;
    for (int s = lane; s < C; s += 32) {
      const int64_t t = a.stamp[s];
      if (t < now && (t < best_stamp || (t == best_stamp && s < best))) best_stamp = t, best = s;
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      const int64_t other_stamp = __shfl_down_sync(0xffffffffu, best_stamp, offset);
      const int other = __shfl_down_sync(0xffffffffu, best, offset);
      if (other_stamp < best_stamp || (other_stamp == best_stamp && other < best)) best_stamp = other_stamp, best = other;
    }
    best = __shfl_sync(0xffffffffu, best, 0);
    __syncwarp();  // every lane has read slot_of[e] above before lane 0 writes it
    if (lane == 0) {
      if (best == C) {
        ++dropped;  // every slot is in use by this block or the one running (a prefetch only: see the constructor)
      } else {
        const int32_t old = a.expert_in_slot[best];
        if (old >= 0) {
          a.slot_of[old] = -1;
          if (old / E == a.block) slot_of[old % E] = -1;  // an unchosen expert of this very block
        }
        const int32_t id = static_cast<int32_t>(a.block * a.experts + e);
        a.expert_in_slot[best] = id;
        block_slots[e] = best;
        slot_of[e] = best;
        a.stamp[best] = now;
        a.prefetched[best] = a.prefetch ? 1 : 0;
        a.copies[1 + 2 * listed] = id;
        a.copies[2 + 2 * listed] = best;
        ++listed;
      }
    }
    __syncwarp();
  }
  if (lane == 0) {
    a.copies[0] = listed;
    int64_t* c = a.counters;
    if (a.prefetch) {
      c[kPrefetched] += listed;
      c[kPrefetchDropped] += dropped;
    } else {
      c[kAcquires] += 1;
      c[kHits] += hits;
      c[kMisses] += listed + dropped;
      c[kPrefetchedUsed] += used;
    }
    c[kBytesCopied] += listed * a.expert_bytes;
  }
  if (!a.prefetch) {  // the block's tables: chosen experts at their slots, the others at the poison expert
    __syncwarp();
    for (int e = lane; e < E; e += 32) {
      const int32_t s = needed[e] ? slot_of[e] : -1;
      const bf16* w1 = s >= 0 ? a.slot_memory + int64_t{s} * a.expert_elements : a.poison;
      a.tables[e] = w1;
      a.tables[E + e] = w1 + a.w1_elements;
    }
  }
}

// The listed experts, 16 bytes a thread per load, four loads in flight per thread: PCIe reads issued
// by the SMs from the pinned store (mapped), written into the slots.
__global__ void __launch_bounds__(kCopyThreads)
    copy_kernel(const int32_t* copies, const uint4* host, uint4* slots, int64_t vectors_per_expert) {
  const int64_t total = int64_t{copies[0]} * vectors_per_expert;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t base = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; base < total; base += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t i = base + u * stride;
      if (i < total) {
        const int64_t c = i / vectors_per_expert, at = i % vectors_per_expert;
        v[u] = host[int64_t{copies[1 + 2 * c]} * vectors_per_expert + at];
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t i = base + u * stride;
      if (i < total) {
        const int64_t c = i / vectors_per_expert, at = i % vectors_per_expert;
        slots[int64_t{copies[2 + 2 * c]} * vectors_per_expert + at] = v[u];
      }
    }
  }
}

}  // namespace

DeviceSlotCache::DeviceSlotCache(const PinnedExpertStore& store, const DeviceSlotCacheOptions& options)
    : store_(&store), copy_blocks_(options.copy_blocks) {
  const ExpertShape& shape = store.shape();
  blocks_ = shape.blocks;
  experts_ = shape.experts;
  slots_ = options.cache_slots;
  expert_elements_ = shape.expert_elements();
  if (experts_ > kMaxExperts) {
    throw std::invalid_argument("DeviceSlotCache: E = " + std::to_string(experts_) + " experts per block; allowed: 1.." +
                                std::to_string(kMaxExperts));
  }
  if (options.max_tokens_per_step < 1 || options.top_k < 1 || options.top_k > experts_) {
    throw std::invalid_argument("DeviceSlotCache: max_tokens_per_step = " + std::to_string(options.max_tokens_per_step) +
                                ", top_k = " + std::to_string(options.top_k) + "; allowed: >= 1 and 1..E = " +
                                std::to_string(experts_));
  }
  // Every acquire finds its experts a slot: at most min(E, tokens * K) of them, and only they are kept.
  const int64_t minimum = minimum_cache_slots(experts_, options.max_tokens_per_step, options.top_k);
  check_cache_size(slots_, minimum, experts_, options.max_tokens_per_step, options.top_k, shape.expert_bytes());
  if (slots_ > blocks_ * experts_) {
    throw std::invalid_argument("DeviceSlotCache: cache_slots = " + std::to_string(slots_) + "; allowed: up to every "
                                "expert of every block, " + std::to_string(blocks_ * experts_));
  }
  if (copy_blocks_ < 1 || copy_blocks_ > 1024) {
    throw std::invalid_argument("DeviceSlotCache: copy_blocks = " + std::to_string(copy_blocks_) + "; allowed: 1..1024");
  }
  if (shape.expert_bytes() % sizeof(uint4) != 0 || (shape.w1_elements() * sizeof(bf16)) % sizeof(uint4) != 0) {
    throw std::invalid_argument("DeviceSlotCache: an expert of " + std::to_string(shape.expert_bytes()) +
                                " bytes; the copy kernel moves 16-byte vectors, so D * H must be a multiple of 8");
  }
  void* mapped = nullptr;
  const cudaError_t status = cudaHostGetDevicePointer(&mapped, const_cast<bf16*>(store.data()), 0);
  if (status != cudaSuccess || mapped == nullptr) {
    (void)cudaGetLastError();
    throw std::runtime_error(std::string("DeviceSlotCache: the pinned expert store is not mapped into the device's "
                                         "address space (cudaHostGetDevicePointer: ") + cudaGetErrorString(status) +
                             "); the copy kernel reads it there");
  }
  host_experts_ = static_cast<const bf16*>(mapped);

  slot_memory_ = DeviceBuffer<bf16>(size_t(slots_ * expert_elements_));
  poison_ = DeviceBuffer<bf16>(size_t(expert_elements_));
  fill_nan(poison_.data(), poison_.size(), nullptr);
  tables_ = DeviceBuffer<const bf16*>(size_t(blocks_ * 2 * experts_));
  slot_of_ = DeviceBuffer<int32_t>(size_t(blocks_ * experts_));
  slot_of_.fill_bytes(0xFF, nullptr);  // -1: nothing resident
  expert_in_slot_ = DeviceBuffer<int32_t>(size_t(slots_));
  expert_in_slot_.fill_bytes(0xFF, nullptr);
  stamp_ = DeviceBuffer<int64_t>(size_t(slots_));
  stamp_.fill_bytes(0xFF, nullptr);  // -1: an empty slot is older than any use, a prefetch's at clock 0 included
  prefetched_ = DeviceBuffer<int32_t>(size_t(slots_));
  prefetched_.fill_bytes(0, nullptr);
  clock_ = DeviceBuffer<int64_t>(1);
  clock_.fill_bytes(0, nullptr);
  copies_ = DeviceBuffer<int32_t>(size_t(2 * (1 + 2 * experts_)));  // the acquire's list, then the prefetch's
  copies_.fill_bytes(0, nullptr);
  counters_ = DeviceBuffer<int64_t>(size_t(blocks_ * kCounters));
  counters_.fill_bytes(0, nullptr);
  CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
  CUDA_CHECK(cudaDeviceSynchronize());
}

DeviceSlotCache::~DeviceSlotCache() {
  if (copy_stream_ != nullptr) {
    cudaStreamSynchronize(copy_stream_);
    cudaStreamDestroy(copy_stream_);
  }
  if (fork_ != nullptr) cudaEventDestroy(fork_);
  if (join_ != nullptr) cudaEventDestroy(join_);
}

size_t DeviceSlotCache::device_bytes() const {
  return slot_memory_.bytes() + poison_.bytes() + tables_.bytes() + slot_of_.bytes() + expert_in_slot_.bytes() +
         stamp_.bytes() + prefetched_.bytes() + clock_.bytes() + copies_.bytes() + counters_.bytes();
}

ExpertTables DeviceSlotCache::acquire(int64_t, std::span<const int32_t>, cudaStream_t) {
  throw std::logic_error("DeviceSlotCache: its slot table is on the device: call acquire_on_device with the block's "
                         "routing on the device (plans_on_device() is true)");
}

void DeviceSlotCache::release(int64_t block, cudaStream_t) { check_block("release", block, 0); }

void DeviceSlotCache::check_block(const char* function, int64_t block, int64_t slots) const {
  if (block < 0 || block >= blocks_) {
    throw std::invalid_argument(std::string("DeviceSlotCache::") + function + ": MoE block " + std::to_string(block) +
                                "; allowed: 0.." + std::to_string(blocks_ - 1));
  }
  if (slots < 0) {
    throw std::invalid_argument(std::string("DeviceSlotCache::") + function + ": " + std::to_string(slots) +
                                " routing slots; allowed: >= 0");
  }
}

const int32_t* DeviceSlotCache::enqueue_plan(int64_t block, const int32_t* top_experts, int64_t slots, bool prefetch,
                                             cudaStream_t stream) {
  PlanArgs a;
  a.top = top_experts;
  a.count = slots;
  a.block = block;
  a.experts = experts_;
  a.slots = slots_;
  a.prefetch = prefetch;
  a.slot_of = slot_of_.data();
  a.expert_in_slot = expert_in_slot_.data();
  a.stamp = stamp_.data();
  a.prefetched = prefetched_.data();
  a.clock = clock_.data();
  a.copies = copies_.data() + (prefetch ? 1 + 2 * experts_ : 0);
  a.counters = counters_.data() + block * kCounters;
  a.tables = tables_.data() + block * 2 * experts_;
  a.slot_memory = slot_memory_.data();
  a.poison = poison_.data();
  a.expert_elements = expert_elements_;
  a.w1_elements = store_->shape().w1_elements();
  a.expert_bytes = static_cast<int64_t>(store_->expert_bytes());
  plan_kernel<<<1, 32, 0, stream>>>(a);
  CUDA_CHECK(cudaGetLastError());
  return a.copies;
}

void DeviceSlotCache::enqueue_copies(const int32_t* copies, cudaStream_t stream) {
  const int64_t vectors = expert_elements_ * int64_t{sizeof(bf16)} / int64_t{sizeof(uint4)};
  copy_kernel<<<copy_blocks_, kCopyThreads, 0, stream>>>(copies, reinterpret_cast<const uint4*>(host_experts_),
                                                          reinterpret_cast<uint4*>(slot_memory_.data()), vectors);
  CUDA_CHECK(cudaGetLastError());
}

ExpertTables DeviceSlotCache::acquire_on_device(int64_t block, const int32_t* top_experts, int64_t slots,
                                                cudaStream_t compute) {
  check_block("acquire_on_device", block, slots);
  if (top_experts == nullptr) throw std::invalid_argument("DeviceSlotCache::acquire_on_device: no routing (nullptr)");
  join_prefetch(compute);  // its copies end before any slot is chosen or read again
  enqueue_copies(enqueue_plan(block, top_experts, slots, /*prefetch=*/false, compute), compute);
  const bf16* const* tables = tables_.data() + block * 2 * experts_;
  return ExpertTables{tables, tables + experts_};
}

void DeviceSlotCache::prefetch_on_device(int64_t block, const int32_t* top_experts, int64_t slots,
                                         cudaStream_t compute) {
  check_block("prefetch_on_device", block, slots);
  join_prefetch(compute);  // two prefetches without an acquire between: the second plans after the first's copies
  // The plan on the compute stream, in order with the acquires (it reads the routing there and owns
  // the table); its copies forked onto the cache's stream, joined by the next acquire.
  const int32_t* copies = enqueue_plan(block, top_experts, slots, /*prefetch=*/true, compute);
  CUDA_CHECK(cudaEventRecord(fork_, compute));
  CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, fork_, 0));
  enqueue_copies(copies, copy_stream_);
  CUDA_CHECK(cudaEventRecord(join_, copy_stream_));
  prefetch_pending_ = true;
}

void DeviceSlotCache::join_prefetch(cudaStream_t compute) {
  if (!prefetch_pending_) return;
  CUDA_CHECK(cudaStreamWaitEvent(compute, join_, 0));
  prefetch_pending_ = false;
}

OffloadStatistics DeviceSlotCache::statistics() const {
  std::vector<int64_t> counts = counters_.download();
  OffloadStatistics out;
  for (int64_t b = 0; b < blocks_; ++b) {
    const int64_t* c = counts.data() + b * kCounters;
    BlockOffloadStatistics s;
    s.acquires = c[kAcquires];
    s.hits = c[kHits];
    s.misses = c[kMisses];
    s.prefetched = c[kPrefetched];
    s.prefetched_used = c[kPrefetchedUsed];
    s.prefetch_dropped = c[kPrefetchDropped];
    s.bytes_copied = c[kBytesCopied];
    out.blocks.push_back(s);
  }
  return out;
}

void DeviceSlotCache::reset_statistics() {
  counters_.fill_bytes(0, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace moe::cuda
