// test_offload.cpp: the offload engine of Pre-gated MoE (cuda/offload/): the cache's size in slots
// or MB on the CPU (its eviction rules, plain C++, are tests/offload/test_cache_policy.cpp); on the GPU,
// that the pointer tables a block gets from acquire() point at exactly the pinned store's bytes under
// random sequences of acquire / prefetch / release with a cache smaller than all experts, that
// unchosen experts point at the NaN poison, that a copy never overwrites a slot still being read,
// and that bad input is a clear error. Nothing here is timed.
// Run: ctest --test-dir build -R Offload --output-on-failure   (the GPU tests skip without a GPU)
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/cuda_check.h"              // CUDA_CHECK
#include "core/device_buffer.h"           // DeviceBuffer
#include "gpu_test_support.h"             // REQUIRE_GPU
#include "offload/cache_policy.h"         // CachePolicy
#include "offload/expert_cache.h"         // BlockOffloadStatistics
#include "offload/offloaded_experts.h"    // OffloadedExperts, OffloadOptions
#include "offload/pinned_expert_store.h"  // PinnedExpertStore, ExpertShape
#include "offload/resident_experts.h"     // ResidentExperts

namespace {

using moe::cuda::bf16;
using moe::cuda::CachePolicy;
using moe::cuda::ExpertShape;
using moe::cuda::ExpertTables;
using moe::cuda::OffloadedExperts;
using moe::cuda::OffloadOptions;
using moe::cuda::PinnedExpertStore;

// Throws E and expects every `fragment` in its message.
template <typename Exception, typename Call>
void expect_error(Call call, const std::vector<std::string>& fragments) {
  try {
    call();
    ADD_FAILURE() << "no exception";
  } catch (const Exception& error) {
    for (const std::string& fragment : fragments) {
      EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos)
          << "'" << fragment << "' not in: " << error.what();
    }
  }
}

// ---- the cache size, in slots or MB (the eviction rules: tests/offload/test_cache_policy.cpp) ----

TEST(CudaOffload, CacheSizeInSlotsOrMegabytesExactlyOne) {
  const size_t expert_bytes = 4 * 768 * 3072;  // 9.4 MB
  OffloadOptions options;
  expect_error<std::invalid_argument>([&] { moe::cuda::cache_slots_of(options, expert_bytes); }, {"exactly one"});
  options.cache_slots = 4;
  options.cache_megabytes = 40;
  EXPECT_THROW(moe::cuda::cache_slots_of(options, expert_bytes), std::invalid_argument);
  options.cache_megabytes = 0;
  EXPECT_EQ(moe::cuda::cache_slots_of(options, expert_bytes), 4);
  options.cache_slots = 0;
  options.cache_megabytes = 40;
  EXPECT_EQ(moe::cuda::cache_slots_of(options, expert_bytes), 4);
}

TEST(CudaOffloadStore, ShapesAndTheHostMemoryCheck) {
  const ExpertShape gelu{12, 64, 768, 3072, 0};
  EXPECT_EQ(gelu.expert_bytes(), 4u * 768 * 3072);  // 4*D*H: 9.4 MB
  EXPECT_EQ(gelu.total_bytes(), size_t{12} * 64 * 4 * 768 * 3072);  // 7.2 GB
  const ExpertShape swiglu{1, 8, 4, 6, 12};
  EXPECT_EQ(swiglu.expert_elements(), 4 * 12 + 6 * 4);
  EXPECT_THROW(moe::cuda::validate(ExpertShape{0, 8, 4, 6, 0}), std::invalid_argument);
  EXPECT_THROW(moe::cuda::validate(ExpertShape{1, 8, 4, 6, 7}), std::invalid_argument);

  EXPECT_GT(moe::cuda::host_memory_available(), 0u);  // Linux has /proc/meminfo
  EXPECT_NO_THROW(moe::cuda::check_pinned_request(70'000'000'000, 100'000'000'000));
  expect_error<std::runtime_error>([] { moe::cuda::check_pinned_request(80'000'000'000, 100'000'000'000); },
                                   {"80.00 GB", "75%", "100.00 GB", "MemAvailable"});
  EXPECT_NO_THROW(moe::cuda::check_pinned_request(80'000'000'000, 0));  // unknown: the pin decides
}

// ---- on the GPU ----

// A non-blocking stream, as a decoding model's: it does not synchronise with the legacy default
// stream, so no ordering in these tests comes from an implicit synchronisation.
struct Stream {
  cudaStream_t stream = nullptr;
  Stream() { CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream); }
};

struct HostTables {
  std::vector<const bf16*> w1, w2;  // [E]
};

HostTables download(ExpertTables tables, int64_t experts, cudaStream_t stream) {
  HostTables host{std::vector<const bf16*>(static_cast<size_t>(experts)), std::vector<const bf16*>(static_cast<size_t>(experts))};
  CUDA_CHECK(cudaMemcpyAsync(host.w1.data(), tables.w1, host.w1.size() * sizeof(const bf16*), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaMemcpyAsync(host.w2.data(), tables.w2, host.w2.size() * sizeof(const bf16*), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

std::vector<unsigned char> download_bytes(const void* device, size_t bytes, cudaStream_t stream) {
  std::vector<unsigned char> host(bytes);
  CUDA_CHECK(cudaMemcpyAsync(host.data(), device, bytes, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

bool equals_store(const std::vector<unsigned char>& bytes, const PinnedExpertStore& store, int64_t block, int32_t expert) {
  return bytes.size() == store.expert_bytes() && std::memcmp(bytes.data(), store.expert(block, expert), bytes.size()) == 0;
}

// After acquire (compute already waits for the copies): chosen experts' w1 pointers hold the store's
// bytes bit for bit (w1 then w2, one expert) and w2 = w1 + D*W1; unchosen ones point at the poison.
void expect_tables_hold_store(const OffloadedExperts& source, int64_t block, const std::vector<int32_t>& experts,
                              ExpertTables tables, cudaStream_t compute) {
  const PinnedExpertStore& store = source.store();
  const int64_t expert_count = store.shape().experts;
  const HostTables host = download(tables, expert_count, compute);
  const std::set<int32_t> chosen(experts.begin(), experts.end());
  for (int32_t e = 0; e < expert_count; ++e) {
    const auto i = static_cast<size_t>(e);
    if (chosen.count(e) > 0) {
      EXPECT_TRUE(equals_store(download_bytes(host.w1[i], store.expert_bytes(), compute), store, block, e))
          << "block " << block << " expert " << e << ": the slot differs from the pinned store";
      EXPECT_EQ(host.w2[i], host.w1[i] + store.shape().w1_elements());
    } else {
      EXPECT_EQ(host.w1[i], source.poison_expert()) << "unchosen expert " << e;
      EXPECT_EQ(host.w2[i], source.poison_expert() + store.shape().w1_elements()) << "unchosen expert " << e;
    }
  }
}

// Holds `stream` for `milliseconds` on the host's callback thread: everything enqueued on the stream
// after it waits, like a long kernel, and the host goes on enqueuing meanwhile.
void hold_stream(cudaStream_t stream, int milliseconds) {
  CUDA_CHECK(cudaLaunchHostFunc(
      stream,
      [](void* duration) {
        std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<uintptr_t>(duration)));
      },
      reinterpret_cast<void*>(static_cast<uintptr_t>(milliseconds))));
}

const ExpertShape kSmallShape{3, 8, 32, 64, 0};  // 3 MoE blocks of 8 experts, 8 KiB each

TEST(CudaOffload, TablesHoldTheStoreBytesUnderRandomSequences) {
  REQUIRE_GPU();
  const PinnedExpertStore store = PinnedExpertStore::random(kSmallShape, 11);
  const int64_t experts = kSmallShape.experts;
  for (const CachePolicy policy : {CachePolicy::lru, CachePolicy::lfu, CachePolicy::next_use}) {
    for (const uint64_t seed : {1u, 2u, 3u}) {
      SCOPED_TRACE(moe::cuda::to_string(policy) + " seed " + std::to_string(seed));
      OffloadOptions options;
      options.cache_slots = 5;  // of 24 experts
      options.policy = policy;
      options.max_tokens_per_step = 2;
      options.top_k = 2;
      OffloadedExperts source(store, options);
      Stream compute;
      std::mt19937_64 generator(seed);
      // Every acquired expert is also read later, after a random hold of the compute stream, into
      // its own output: a copy that overwrote a slot under that read would show at the end.
      const int steps = 300;
      moe::cuda::DeviceBuffer<unsigned char> reads(static_cast<size_t>(steps * 4) * store.expert_bytes());
      struct Read {
        int64_t block;
        int32_t expert;
      };
      std::vector<Read> expected;
      std::vector<int64_t> held;
      int64_t chosen_total = 0;
      for (int step = 0; step < steps; ++step) {
        const int op = static_cast<int>(generator() % 3);
        const int64_t free_slots = source.cache().slots() - source.cache().slot_map().pinned_slots();
        if (op == 0 && held.size() < 2 && free_slots > 0) {
          int64_t block = static_cast<int64_t>(generator() % kSmallShape.blocks);
          while (std::count(held.begin(), held.end(), block) > 0) block = (block + 1) % kSmallShape.blocks;
          const int64_t count = 1 + static_cast<int64_t>(generator() % static_cast<uint64_t>(std::min<int64_t>(4, free_slots)));
          std::set<int32_t> picked;
          while (static_cast<int64_t>(picked.size()) < count) picked.insert(static_cast<int32_t>(generator() % experts));
          const std::vector<int32_t> chosen(picked.begin(), picked.end());
          const ExpertTables tables = source.acquire(block, chosen, compute.stream);
          expect_tables_hold_store(source, block, chosen, tables, compute.stream);
          const HostTables host = download(tables, experts, compute.stream);
          hold_stream(compute.stream, static_cast<int>(generator() % 3));
          for (const int32_t e : chosen) {
            CUDA_CHECK(cudaMemcpyAsync(reads.data() + expected.size() * store.expert_bytes(), host.w1[static_cast<size_t>(e)],
                                       store.expert_bytes(), cudaMemcpyDeviceToDevice, compute.stream));
            expected.push_back(Read{block, e});
          }
          held.push_back(block);
          chosen_total += count;
        } else if (op == 1) {
          const int64_t block = static_cast<int64_t>(generator() % kSmallShape.blocks);
          std::set<int32_t> picked;
          const uint64_t count = 1 + generator() % static_cast<uint64_t>(experts);
          while (picked.size() < count) picked.insert(static_cast<int32_t>(generator() % experts));
          source.prefetch(block, std::vector<int32_t>(picked.begin(), picked.end()));
        } else if (!held.empty()) {
          const size_t which = generator() % held.size();
          source.release(held[which], compute.stream);
          held.erase(held.begin() + static_cast<std::ptrdiff_t>(which));
        }
      }
      for (const int64_t block : held) source.release(block, compute.stream);
      CUDA_CHECK(cudaStreamSynchronize(compute.stream));
      for (size_t i = 0; i < expected.size(); ++i) {
        const std::vector<unsigned char> bytes = download_bytes(reads.data() + i * store.expert_bytes(), store.expert_bytes(), compute.stream);
        ASSERT_TRUE(equals_store(bytes, store, expected[i].block, expected[i].expert))
            << "read " << i << " (block " << expected[i].block << ", expert " << expected[i].expert
            << ") was overwritten before the compute stream read it";
      }
      const moe::cuda::BlockOffloadStatistics total = source.statistics().total();
      EXPECT_EQ(total.hits + total.misses, chosen_total);
      EXPECT_LE(total.prefetched_used, total.prefetched);
      EXPECT_EQ(total.bytes_copied, (total.misses + total.prefetched) * static_cast<int64_t>(store.expert_bytes()));
      EXPECT_EQ(total.copies_timed, total.misses + total.prefetched);
      EXPECT_GT(total.misses, 0);
      EXPECT_GT(total.hits, 0);
    }
  }
}

TEST(CudaOffload, PrefetchThenAcquireCountsAHitAndAUsedPrefetch) {
  REQUIRE_GPU();
  const PinnedExpertStore store = PinnedExpertStore::random(ExpertShape{2, 8, 32, 64, 0}, 5);
  OffloadOptions options;
  options.cache_slots = 4;
  options.max_tokens_per_step = 2;
  options.top_k = 1;
  OffloadedExperts source(store, options);
  Stream compute;
  const int64_t expert_bytes = static_cast<int64_t>(store.expert_bytes());

  source.prefetch(1, std::vector<int32_t>{2, 5});  // block i's pre-gate guessed experts 2 and 5 of block 1
  const std::vector<int32_t> chosen{2};              // block 1's router chose expert 2
  const ExpertTables tables = source.acquire(1, chosen, compute.stream);
  expect_tables_hold_store(source, 1, chosen, tables, compute.stream);
  source.release(1, compute.stream);
  moe::cuda::BlockOffloadStatistics block = source.statistics().blocks[1];
  EXPECT_EQ(block.acquires, 1);
  EXPECT_EQ(block.hits, 1);
  EXPECT_EQ(block.misses, 0);
  EXPECT_EQ(block.prefetched, 2);
  EXPECT_EQ(block.prefetched_used, 1);
  EXPECT_DOUBLE_EQ(block.prefetch_accuracy(), 0.5);
  EXPECT_EQ(block.bytes_copied, 2 * expert_bytes);
  EXPECT_EQ(source.statistics().blocks[0].acquires, 0);

  // A second use of the same prefetched expert is a hit, not a second used prefetch; a hint for a
  // resident expert copies nothing.
  source.prefetch(1, std::vector<int32_t>{2});
  source.acquire(1, chosen, compute.stream);
  source.release(1, compute.stream);
  block = source.statistics().blocks[1];
  EXPECT_EQ(block.hits, 2);
  EXPECT_EQ(block.prefetched, 2);
  EXPECT_EQ(block.prefetched_used, 1);

  // On demand: a miss for block 0.
  source.acquire(0, std::vector<int32_t>{0, 7}, compute.stream);
  block = source.statistics().blocks[0];
  EXPECT_EQ(block.misses, 2);
  EXPECT_EQ(block.hit_rate(), 0.0);
  // With block 0 holding 2 of the 4 slots and block 1 holding 2, a hint has no slot to go to.
  source.acquire(1, std::vector<int32_t>{2, 5}, compute.stream);
  source.prefetch(1, std::vector<int32_t>{6});
  EXPECT_EQ(source.statistics().blocks[1].prefetch_dropped, 1);
  source.release(0, compute.stream);
  source.release(1, compute.stream);
  CUDA_CHECK(cudaStreamSynchronize(compute.stream));

  source.reset_statistics();
  EXPECT_EQ(source.statistics().total().acquires, 0);
}

TEST(CudaOffload, ACopyNeverOverwritesASlotStillInUse) {
  REQUIRE_GPU();
  const PinnedExpertStore store = PinnedExpertStore::random(ExpertShape{1, 4, 256, 512, 0}, 9);  // 512 KiB experts
  for (const bool by_prefetch : {false, true}) {
    SCOPED_TRACE(by_prefetch ? "evicted by prefetch" : "evicted by acquire");
    OffloadOptions options;
    options.cache_slots = 2;
    options.max_tokens_per_step = 2;
    OffloadedExperts source(store, options);
    Stream compute;
    const std::vector<int32_t> first{0, 1};
    const HostTables tables = download(source.acquire(0, first, compute.stream), 4, compute.stream);
    // The block's "kernel": the compute stream is held for 50 ms, then reads both slots into outputs.
    moe::cuda::DeviceBuffer<unsigned char> out(2 * store.expert_bytes());
    hold_stream(compute.stream, 50);
    for (size_t i = 0; i < 2; ++i) {
      CUDA_CHECK(cudaMemcpyAsync(out.data() + i * store.expert_bytes(), tables.w1[i], store.expert_bytes(),
                                 cudaMemcpyDeviceToDevice, compute.stream));
    }
    source.release(0, compute.stream);
    // Experts 2 and 3 evict both slots while the reads above have not run yet (the host is not held).
    const std::vector<int32_t> second{2, 3};
    if (by_prefetch) {
      source.prefetch(0, second);
    } else {
      source.acquire(0, second, compute.stream);
    }
    for (const int32_t e : second) {
      const std::optional<int64_t> slot = source.cache().slot_map().find(0, e);
      ASSERT_TRUE(slot.has_value());
      EXPECT_TRUE(source.cache().slot(*slot) == tables.w1[0] || source.cache().slot(*slot) == tables.w1[1])
          << "the new experts should reuse the first ones' slots";
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    for (int32_t e = 0; e < 2; ++e) {
      EXPECT_TRUE(equals_store(download_bytes(out.data() + static_cast<size_t>(e) * store.expert_bytes(),
                                              store.expert_bytes(), compute.stream), store, 0, e))
          << "expert " << e << "'s slot was overwritten while the compute stream still read it";
    }
    if (!by_prefetch) source.release(0, compute.stream);
    for (const int32_t e : second) {  // and the slots now hold the new experts
      const int64_t slot = source.cache().slot_map().find(0, e).value();
      EXPECT_TRUE(equals_store(download_bytes(source.cache().slot(slot), store.expert_bytes(), compute.stream), store, 0, e));
    }
  }
}

TEST(CudaOffload, UnchosenExpertsPointAtNaN) {
  REQUIRE_GPU();
  const PinnedExpertStore store = PinnedExpertStore::random(kSmallShape, 3);
  OffloadOptions options;
  options.cache_slots = 2;
  OffloadedExperts source(store, options);
  Stream compute;
  const ExpertTables tables = source.acquire(2, std::vector<int32_t>{4}, compute.stream);
  expect_tables_hold_store(source, 2, {4}, tables, compute.stream);
  source.release(2, compute.stream);
  std::vector<bf16> poison(static_cast<size_t>(kSmallShape.expert_elements()));
  CUDA_CHECK(cudaMemcpy(poison.data(), source.poison_expert(), poison.size() * sizeof(bf16), cudaMemcpyDeviceToHost));
  for (const bf16 value : poison) ASSERT_TRUE(std::isnan(__bfloat162float(value)));
}

TEST(CudaOffload, BadInputIsAClearError) {
  REQUIRE_GPU();
  const PinnedExpertStore store = PinnedExpertStore::random(ExpertShape{2, 8, 32, 64, 0}, 1);
  Stream compute;
  OffloadOptions options;
  options.max_tokens_per_step = 2;
  options.top_k = 2;
  options.cache_slots = 3;  // the minimum is min(8, 2*2) = 4
  expect_error<std::invalid_argument>([&] { OffloadedExperts source(store, options); },
                                      {"3 slots", "minimum_cache_slots", "4 slots"});
  options.cache_slots = 0;
  options.cache_megabytes = 0.02;  // two experts of 8 KiB
  expect_error<std::invalid_argument>([&] { OffloadedExperts source(store, options); }, {"2 slots", "minimum_cache_slots"});
  options.cache_megabytes = 0;
  expect_error<std::invalid_argument>([&] { OffloadedExperts source(store, options); }, {"exactly one"});  // no size

  options.cache_slots = 4;
  OffloadedExperts source(store, options);
  using Experts = std::vector<int32_t>;
  expect_error<std::invalid_argument>([&] { source.acquire(2, Experts{0}, compute.stream); }, {"block 2", "[0, 2)"});
  expect_error<std::invalid_argument>([&] { source.acquire(-1, Experts{0}, compute.stream); }, {"block -1"});
  expect_error<std::invalid_argument>([&] { source.acquire(0, Experts{8}, compute.stream); }, {"expert 8", "E=8"});
  expect_error<std::invalid_argument>([&] { source.acquire(0, Experts{-1}, compute.stream); }, {"expert -1"});
  expect_error<std::invalid_argument>([&] { source.acquire(0, Experts{3, 1}, compute.stream); }, {"sorted"});
  expect_error<std::invalid_argument>([&] { source.acquire(0, Experts{1, 1}, compute.stream); }, {"unique"});
  expect_error<std::invalid_argument>([&] { source.acquire(0, Experts{0, 1, 2, 3, 4}, compute.stream); },
                                      {"needs 5 experts", "4 of the cache's 4 slots"});
  expect_error<std::invalid_argument>([&] { source.prefetch(1, Experts{9}); }, {"expert 9"});
  expect_error<std::invalid_argument>([&] { source.prefetch(5, Experts{0}); }, {"block 5"});
  expect_error<std::logic_error>([&] { source.release(0, compute.stream); }, {"without acquire"});
  source.acquire(0, Experts{1, 6}, compute.stream);
  expect_error<std::logic_error>([&] { source.acquire(0, Experts{1}, compute.stream); }, {"release it first"});
  expect_error<std::invalid_argument>([&] { source.acquire(1, Experts{0, 1, 2}, compute.stream); },
                                      {"needs 3 experts", "only 2"});
  source.release(0, compute.stream);
  // None of the errors changed anything: the source still serves.
  const Experts chosen{0, 1, 2, 3};
  expect_tables_hold_store(source, 1, chosen, source.acquire(1, chosen, compute.stream), compute.stream);
  source.release(1, compute.stream);
  EXPECT_EQ(source.statistics().total().acquires, 2);

  moe::cuda::ResidentExperts resident(store);
  expect_error<std::invalid_argument>([&] { resident.acquire(2, Experts{}, compute.stream); }, {"block 2"});
  EXPECT_THROW(store.expert(0, 8), std::invalid_argument);
  PinnedExpertStore other(ExpertShape{1, 2, 4, 6, 0});
  const std::vector<bf16> wrong(5);
  expect_error<std::invalid_argument>([&] { other.set_block(0, wrong, wrong); }, {"[E, D, W1]", "48"});
  expect_error<std::invalid_argument>([&] { other.set_expert(0, 0, wrong, wrong); }, {"[D, W1]", "24"});
  CUDA_CHECK(cudaStreamSynchronize(compute.stream));
}

TEST(CudaOffload, ResidentExpertsPointAtEveryExpert) {
  REQUIRE_GPU();
  const PinnedExpertStore store = PinnedExpertStore::random(kSmallShape, 21);
  moe::cuda::ResidentExperts resident(store);
  EXPECT_FALSE(resident.needs_experts_on_host());
  EXPECT_EQ(resident.device_bytes(), store.bytes() + static_cast<size_t>(kSmallShape.blocks * 2 * kSmallShape.experts) * sizeof(bf16*));
  Stream compute;
  for (int64_t block = 0; block < kSmallShape.blocks; ++block) {
    const HostTables host = download(resident.acquire(block, {}, compute.stream), kSmallShape.experts, compute.stream);
    for (int32_t e = 0; e < kSmallShape.experts; ++e) {
      EXPECT_TRUE(equals_store(download_bytes(host.w1[static_cast<size_t>(e)], store.expert_bytes(), compute.stream), store, block, e));
      EXPECT_EQ(host.w2[static_cast<size_t>(e)], host.w1[static_cast<size_t>(e)] + kSmallShape.w1_elements());
    }
    resident.release(block, compute.stream);
  }
}

TEST(CudaOffloadStore, LoadsHostArraysAndRandomWeightsAreReproducible) {
  REQUIRE_GPU();  // pinning needs the driver
  const ExpertShape shape{2, 3, 4, 6, 0};
  PinnedExpertStore store(shape);
  EXPECT_EQ(store.bytes(), static_cast<size_t>(2 * 3 * (4 * 6 + 6 * 4)) * sizeof(bf16));
  std::vector<bf16> w1(static_cast<size_t>(3 * shape.w1_elements())), w2(static_cast<size_t>(3 * shape.w2_elements()));
  for (size_t i = 0; i < w1.size(); ++i) w1[i] = __float2bfloat16(static_cast<float>(i));
  for (size_t i = 0; i < w2.size(); ++i) w2[i] = __float2bfloat16(-static_cast<float>(i));
  for (int64_t block = 0; block < 2; ++block) store.set_block(block, w1, w2);
  for (int32_t e = 0; e < 3; ++e) {  // expert e: w1 [D, H] then w2 [H, D], from the stacked [E, ...] arrays
    const bf16* expert = store.expert(1, e);
    EXPECT_EQ(std::memcmp(expert, w1.data() + e * shape.w1_elements(), static_cast<size_t>(shape.w1_elements()) * sizeof(bf16)), 0);
    EXPECT_EQ(std::memcmp(expert + shape.w1_elements(), w2.data() + e * shape.w2_elements(),
                          static_cast<size_t>(shape.w2_elements()) * sizeof(bf16)), 0);
  }

  const ExpertShape bigger{2, 5, 16, 32, 0};
  const PinnedExpertStore a = PinnedExpertStore::random(bigger, 42);
  const PinnedExpertStore b = PinnedExpertStore::random(bigger, 42);
  const PinnedExpertStore c = PinnedExpertStore::random(bigger, 43);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.bytes()), 0);
  EXPECT_NE(std::memcmp(a.data(), c.data(), a.bytes()), 0);
  // Uniform in +-1/sqrt(D) and +-1/sqrt(H), up to bf16's rounding (2^-8 relative).
  const float w1_bound = 1.0f / std::sqrt(16.0f) * (1 + 1.0f / 256), w2_bound = 1.0f / std::sqrt(32.0f) * (1 + 1.0f / 256);
  for (int64_t block = 0; block < bigger.blocks; ++block) {
    for (int32_t e = 0; e < bigger.experts; ++e) {
      const bf16* expert = a.expert(block, e);
      for (int64_t i = 0; i < bigger.expert_elements(); ++i) {
        const float value = __bfloat162float(expert[i]);
        ASSERT_LE(std::fabs(value), i < bigger.w1_elements() ? w1_bound : w2_bound);
      }
    }
  }
}

}  // namespace
