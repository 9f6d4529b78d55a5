// test_phase_timer.cpp: phases nest (a model's "moe" phase holds the layer's own phases), each
// with its depth, the inner ones inside the outer one on the GPU's clock; misuse is an error.
// Run: ctest --test-dir build -R CudaPhaseTimer   (skips without a GPU)
#include <gtest/gtest.h>

#include "core/cuda_check.h"     // CudaError
#include "core/device_buffer.h"  // DeviceBuffer
#include "gpu_test_support.h"    // REQUIRE_GPU
#include "core/phase_timer.h"

namespace {

TEST(CudaPhaseTimer, PhasesNestWithTheirDepth) {
  REQUIRE_GPU();
  moe::cuda::DeviceBuffer<float> buffer(1 << 24);
  moe::cuda::PhaseTimer timer;
  timer.begin("outer", nullptr);
  buffer.fill_bytes(1);
  timer.begin("inner", nullptr);
  buffer.fill_bytes(2);
  timer.end(nullptr);
  buffer.fill_bytes(3);
  timer.end(nullptr);
  timer.begin("after", nullptr);
  timer.end(nullptr);
  const std::vector<moe::cuda::TimedPhase> phases = timer.collect();
  ASSERT_EQ(phases.size(), 3u);
  EXPECT_EQ(phases[0].name, "outer");
  EXPECT_EQ(phases[0].depth, 0);
  EXPECT_EQ(phases[1].name, "inner");
  EXPECT_EQ(phases[1].depth, 1);
  EXPECT_EQ(phases[2].depth, 0);
  EXPECT_GE(phases[1].start_us, phases[0].start_us);
  EXPECT_LE(phases[1].start_us + phases[1].duration_us, phases[0].start_us + phases[0].duration_us + 1.0);
  EXPECT_LT(phases[1].duration_us, phases[0].duration_us);  // one fill of three
  EXPECT_GE(phases[2].start_us, phases[0].start_us + phases[0].duration_us - 1.0);
}

TEST(CudaPhaseTimer, MisuseIsAnError) {
  REQUIRE_GPU();
  moe::cuda::PhaseTimer timer;
  EXPECT_THROW(timer.end(nullptr), moe::cuda::CudaError);
  timer.begin("open", nullptr);
  EXPECT_THROW(timer.collect(), moe::cuda::CudaError);
  timer.end(nullptr);
  EXPECT_EQ(timer.collect().size(), 1u);
  EXPECT_TRUE(timer.collect().empty());  // collect() empties the timer
}

}  // namespace
