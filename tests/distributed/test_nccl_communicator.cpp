// test_nccl_communicator.cpp: the NCCL backend's collectives on device buffers against what each
// rank computes by hand for its peers (the checks of test_communicator.cpp), on fresh random data
// with uneven and zero counts, and sub-groups. One GPU per rank: with fewer GPUs than ranks (NCCL
// refuses two ranks on one device) or none, every test skips and says why. Built where MOE_HAVE_NCCL.
// The suite's communicator shares the world's watchdog (watchdog.h), so every call here also runs
// armed, and the host's waits poll the stream and NCCL's asynchronous error (nccl_wait.h).
//   ctest --test-dir build -R DistributedNcclCommunicator
//   mpirun -np 2 build/tests/distributed/test_distributed_nccl_communicator
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <memory>
#include <numeric>
#include <vector>

#include "distributed_test_support.h"  // pair_count, pair_value, exchange_layout
#include "mpi_test_support.h"
#include "comm/nccl_communicator.h"

namespace moe::dist {
namespace {

using testing::exchange_layout;
using testing::ExchangeLayout;
using testing::expect_pair_blocks_and_untouched_gaps;
using testing::mix;
using testing::pair_count;
using testing::pair_send_buffer;
using testing::shared_seed;
using testing::value_from;
using testing::world;

// Device memory for n elements, with host copies in and out.
template <typename Element>
class DeviceVector {
 public:
  explicit DeviceVector(const std::vector<Element>& host) : size_(host.size()) {
    if (cudaMalloc(&data_, std::max<size_t>(1, size_) * sizeof(Element)) != cudaSuccess) data_ = nullptr;
    if (data_ && size_) cudaMemcpy(data_, host.data(), size_ * sizeof(Element), cudaMemcpyHostToDevice);
  }
  ~DeviceVector() { cudaFree(data_); }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  Element* data() { return data_; }
  std::vector<Element> to_host() const {
    std::vector<Element> host(size_);
    if (size_) cudaMemcpy(host.data(), data_, size_ * sizeof(Element), cudaMemcpyDeviceToHost);
    return host;
  }

 private:
  Element* data_ = nullptr;
  size_t size_ = 0;
};

// One NCCL communicator for the whole suite (joining costs a few hundred milliseconds), or the
// reason there is none. Every rank reaches the same verdict: they see the same devices.
class NcclCommunicatorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
    if (devices < world().size()) {
      skip_reason_ = new std::string("needs one GPU per rank: " + std::to_string(devices) + " GPU(s) for " +
                                     std::to_string(world().size()) + " ranks");
      return;
    }
    cudaSetDevice(world().rank());
    nccl_ = new NcclCommunicator(world(), /*stream=*/nullptr, &testing::watchdog());
  }
  static void TearDownTestSuite() {
    delete nccl_;
    nccl_ = nullptr;
    delete skip_reason_;
    skip_reason_ = nullptr;
  }
  void SetUp() override {
    if (skip_reason_) GTEST_SKIP() << *skip_reason_;
  }
  static NcclCommunicator& nccl() { return *nccl_; }

  static NcclCommunicator* nccl_;
  static std::string* skip_reason_;
};
NcclCommunicator* NcclCommunicatorTest::nccl_ = nullptr;
std::string* NcclCommunicatorTest::skip_reason_ = nullptr;

// The exchange of test_communicator.cpp's check_all_to_all_v, on device buffers through `comm`.
template <typename Element, typename Count>
void check_all_to_all_v(Communicator& comm, uint64_t seed, Count count, int64_t gap) {
  const int me = comm.rank();
  const ExchangeLayout layout = exchange_layout(comm.size(), me, count, gap);
  const Element poison = value_from<Element>(mix(seed, 999));
  DeviceVector<Element> device_send(pair_send_buffer<Element>(seed, me, layout));
  DeviceVector<Element> device_recv(std::vector<Element>(static_cast<size_t>(layout.recv_end + gap), poison));
  comm.all_to_all_v(device_send.data(), layout.send_counts, layout.send_offsets, device_recv.data(),
                    layout.recv_counts, layout.recv_offsets, data_type_of<Element>());
  comm.barrier();
  expect_pair_blocks_and_untouched_gaps(device_recv.to_host(), layout, seed, me, poison);
}

TEST_F(NcclCommunicatorTest, AllToAllVUnevenAndZeroCounts) {
  EXPECT_EQ(nccl().backend(), "nccl");
  EXPECT_EQ(nccl().rank(), world().rank());
  const uint64_t seed = shared_seed();
  check_all_to_all_v<double>(nccl(), seed, [&](int s, int d) { return pair_count(seed, s, d); }, 0);
  check_all_to_all_v<uint16_t>(nccl(), seed, [&](int s, int d) { return 1 + pair_count(seed, s, d); }, 3);
  check_all_to_all_v<int64_t>(nccl(), seed, [&](int s, int d) { return s == 0 ? 0 : pair_count(seed, s, d); }, 1);
  check_all_to_all_v<float>(nccl(), seed, [](int, int) { return int64_t{0}; }, 2);
}

TEST_F(NcclCommunicatorTest, AllReduceSumAllGatherBroadcast) {
  const uint64_t seed = shared_seed();
  const int R = nccl().size(), me = nccl().rank();
  const int64_t n = 300;
  std::vector<double> mine(n);
  std::vector<int64_t> mine_int(n);
  for (int64_t i = 0; i < n; ++i) {
    mine[i] = value_from<double>(mix(seed, me, i));
    mine_int[i] = static_cast<int64_t>(mix(seed, me, i) % 1000);
  }
  DeviceVector<double> sum(mine);
  DeviceVector<int64_t> sum_int(mine_int);
  nccl().all_reduce_sum(sum.data(), sum.data(), n, DataType::float64);
  nccl().all_reduce_sum(sum_int.data(), sum_int.data(), n, DataType::int64);
  DeviceVector<double> gathered(std::vector<double>(n * R, 0.0));
  DeviceVector<double> source(mine);
  nccl().all_gather(source.data(), gathered.data(), n, DataType::float64);
  DeviceVector<double> broadcast_buffer(mine);
  nccl().broadcast(broadcast_buffer.data(), n, DataType::float64, R - 1);
  nccl().barrier();

  const std::vector<double> sums = sum.to_host(), all = gathered.to_host(), from_root = broadcast_buffer.to_host();
  const std::vector<int64_t> sums_int = sum_int.to_host();
  for (int64_t i = 0; i < n; ++i) {
    double expected = 0.0;
    int64_t expected_int = 0;
    for (int p = 0; p < R; ++p) {
      expected += value_from<double>(mix(seed, p, i));
      expected_int += static_cast<int64_t>(mix(seed, p, i) % 1000);
      EXPECT_EQ(all[p * n + i], value_from<double>(mix(seed, p, i))) << "gathered rank " << p << " element " << i;
    }
    EXPECT_NEAR(sums[i], expected, 1e-12 * R) << "element " << i;
    EXPECT_EQ(sums_int[i], expected_int) << "element " << i;
    EXPECT_EQ(from_root[i], value_from<double>(mix(seed, R - 1, i))) << "element " << i;
  }
}

TEST_F(NcclCommunicatorTest, SplitIntoNodes) {
  const uint64_t seed = shared_seed();
  const int R = nccl().size(), me = nccl().rank();
  for (int G = 1; G <= R; ++G) {
    if (R % G != 0) continue;
    SCOPED_TRACE("G = " + std::to_string(G));
    std::unique_ptr<Communicator> node = nccl().split(me / G);
    ASSERT_EQ(node->size(), G);
    ASSERT_EQ(node->rank(), me % G);
    check_all_to_all_v<double>(*node, seed, [&](int s, int d) { return pair_count(seed, s, d); }, 1);
    node->barrier();
  }
}

// The host's wait on NCCL work (nccl_wait.h), on an event and on the stream: it returns once the
// all-reduce is done, and the data is then there without another synchronisation.
TEST_F(NcclCommunicatorTest, WaitReturnsOnceTheEnqueuedWorkIsDone) {
  const int R = nccl().size();
  std::vector<double> mine(1000);
  for (size_t i = 0; i < mine.size(); ++i) mine[i] = 1.0 + nccl().rank() + static_cast<double>(i);
  DeviceVector<double> data(mine);
  cudaEvent_t reduced = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&reduced, cudaEventDisableTiming), cudaSuccess);
  nccl().all_reduce_sum(data.data(), data.data(), static_cast<int64_t>(mine.size()), DataType::float64);
  ASSERT_EQ(cudaEventRecord(reduced, nccl().stream()), cudaSuccess);
  nccl().wait(reduced, "the test's all-reduce (event)");
  EXPECT_EQ(cudaEventQuery(reduced), cudaSuccess);
  nccl().wait(nccl().stream(), "the test's all-reduce (stream)");
  EXPECT_EQ(cudaStreamQuery(nccl().stream()), cudaSuccess);
  const std::vector<double> sum = data.to_host();
  for (size_t i = 0; i < sum.size(); ++i) {
    ASSERT_EQ(sum[i], R * (1.0 + static_cast<double>(i)) + R * (R - 1) / 2.0) << "element " << i;
  }
  cudaEventDestroy(reduced);
}

}  // namespace
}  // namespace moe::dist
