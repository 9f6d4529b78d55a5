// test_block_sparse.cpp: the block-sparse products (SDD, DSD, DDS) equal dense products masked to
// the topology, and the dropless FFN computed through them equals the per-expert computation,
// forward and backward. Run: ctest --test-dir build -R ReferenceBlockSparse
#include <gtest/gtest.h>

#include "block_sparse.h"
#include "block_sparse_ffn.h"
#include "dispatch.h"
#include "expert_ffn.h"
#include "init.h"
#include "permute.h"
#include "router.h"
#include "test_support.h"
#include "topology.h"

namespace moe::ref {
namespace {

using testing::random_input;
using testing::relative_error;
using testing::small_config;

struct Case {
  MoeConfig config;
  DispatchPlan plan;
  BlockSparseTopology topology;
};

Case make_case(int64_t block_size, Activation activation, uint64_t seed) {
  Case c;
  c.config = small_config(Formulation::dropless, activation);
  c.config.tokens = 13;
  c.config.model_dim = 6;
  c.config.num_experts = 5;
  c.config.block_size = block_size;
  c.config.hidden_dim = 2 * block_size;
  const RouterOutput router = route(c.config, random_input(c.config.tokens, c.config.model_dim, seed),
                                    random_input(c.config.model_dim, c.config.num_experts, seed + 1));
  c.plan = plan_dispatch(c.config, router.top_experts);
  c.topology = make_topology(c.config, c.plan);
  return c;
}

// 1 inside the topology's blocks, 0 elsewhere: [M, N]
Matrix block_mask(const BlockSparseTopology& topology) {
  return sparse_to_dense(topology, Matrix::Ones(topology.nnz * topology.block_size, topology.block_size));
}

TEST(ReferenceBlockSparse, ProductsEqualMaskedDenseProducts) {
  uint64_t seed = 300;
  for (int64_t B : {1, 2, 3}) {
    const Case c = make_case(B, Activation::gelu, seed += 10);
    const BlockSparseTopology& topo = c.topology;
    const int64_t M = topo.rows(), N = topo.cols(), Kd = 7, P = 5;
    const Matrix mask = block_mask(topo);
    SCOPED_TRACE("B = " + std::to_string(B));
    EXPECT_GT(mask.sum(), 0.0);
    EXPECT_LT(mask.sum(), static_cast<double>(M * N));  // really sparse

    // sdd: only the blocks of A Bm
    const Matrix a = random_input(M, Kd, seed + 1);
    const Matrix bm = random_input(Kd, N, seed + 2);
    const Matrix s_dense = sparse_to_dense(topo, sdd(a, bm, topo));
    EXPECT_LT(relative_error(s_dense, (a * bm).cwiseProduct(mask)), 1e-14);

    // a sparse S with random values inside the mask
    const Matrix s = dense_to_sparse(topo, random_input(M, N, seed + 3));
    const Matrix s_full = sparse_to_dense(topo, s);
    EXPECT_EQ(s_full.cwiseProduct(mask), s_full);
    EXPECT_EQ(dense_to_sparse(topo, s_full), s);

    // dsd: S Bm and Sᵀ Bm
    const Matrix right_n = random_input(N, P, seed + 4);
    const Matrix right_m = random_input(M, P, seed + 5);
    EXPECT_LT(relative_error(dsd(topo, s, false, right_n), s_full * right_n), 1e-14);
    EXPECT_LT(relative_error(dsd(topo, s, true, right_m), s_full.transpose() * right_m), 1e-14);

    // dds: A S and A Sᵀ
    const Matrix left_m = random_input(P, M, seed + 6);
    const Matrix left_n = random_input(P, N, seed + 7);
    EXPECT_LT(relative_error(dds(left_m, topo, s, false), left_m * s_full), 1e-14);
    EXPECT_LT(relative_error(dds(left_n, topo, s, true), left_n * s_full.transpose()), 1e-14);
  }
}

// The hidden blocks of the block-sparse FFN, as a dense [rows, E*H] matrix, hold each expert's
// per-expert hidden rows in its own column band, and nothing else.
Matrix per_expert_as_dense(const Case& c, const Matrix& per_expert_rows /* [rows, H] */) {
  const int64_t H = c.config.hidden_dim;
  Matrix dense = Matrix::Zero(c.plan.total_rows, c.config.num_experts * H);
  for (int64_t e = 0; e < c.config.num_experts; ++e) {
    const int64_t first = c.plan.row_offsets[e], n = c.plan.rows_per_expert[e];
    dense.block(first, e * H, n, H) = per_expert_rows.middleRows(first, n);
  }
  return dense;
}

class ReferenceBlockSparseFfn : public ::testing::TestWithParam<Activation> {};

TEST_P(ReferenceBlockSparseFfn, ForwardAndBackwardEqualThePerExpertComputation) {
  uint64_t seed = 400;
  for (int64_t B : {1, 2, 4}) {
    const Case c = make_case(B, GetParam(), seed += 10);
    SCOPED_TRACE("B = " + std::to_string(B));
    const MoeWeights weights = random_weights(c.config, seed + 1);
    const Matrix x = random_input(c.config.tokens, c.config.model_dim, seed + 2);
    const Matrix permuted_x = permute_tokens(c.plan, x);

    const ExpertActivations dense = expert_ffn_forward(c.config, c.plan, permuted_x, weights.w1, weights.w2);
    const BlockSparseActivations sparse =
        block_sparse_ffn_forward(c.config, c.topology, permuted_x, weights.w1, weights.w2);
    const int64_t H = c.config.hidden_dim;
    EXPECT_LT(relative_error(sparse_to_dense(c.topology, sparse.pre_activation),
                             per_expert_as_dense(c, dense.pre_activation.leftCols(H))), 1e-14);
    EXPECT_LT(relative_error(sparse_to_dense(c.topology, sparse.hidden), per_expert_as_dense(c, dense.hidden)),
              1e-14);
    EXPECT_LT(relative_error(sparse.out, dense.out), 1e-13);

    const Matrix d_out = random_input(c.plan.total_rows, c.config.model_dim, seed + 3);
    const ExpertGradients g_dense =
        expert_ffn_backward(c.config, c.plan, permuted_x, weights.w1, weights.w2, dense, d_out);
    const ExpertGradients g_sparse =
        block_sparse_ffn_backward(c.config, c.topology, permuted_x, weights.w1, weights.w2, sparse, d_out);
    EXPECT_LT(relative_error(g_sparse.permuted_x, g_dense.permuted_x), 1e-13);
    for (int64_t e = 0; e < c.config.num_experts; ++e) {
      if (c.plan.rows_per_expert[e] == 0) {  // an expert without tokens gets zero gradients
        EXPECT_EQ(g_sparse.w1[e].cwiseAbs().maxCoeff(), 0.0);
        EXPECT_EQ(g_dense.w1[e].cwiseAbs().maxCoeff(), 0.0);
        continue;
      }
      EXPECT_LT(relative_error(g_sparse.w1[e], g_dense.w1[e]), 1e-13) << "expert " << e;
      EXPECT_LT(relative_error(g_sparse.w2[e], g_dense.w2[e]), 1e-13) << "expert " << e;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Activations, ReferenceBlockSparseFfn,
                         ::testing::Values(Activation::gelu, Activation::swiglu),
                         [](const auto& info) { return std::string(to_string(info.param)); });

TEST(ReferenceBlockSparse, ActivationDerivativesMatchFiniteDifferences) {
  const double h = 1e-6;
  for (double a : {-3.0, -0.7, 0.0, 0.3, 2.5}) {
    EXPECT_NEAR(gelu_derivative(a), (gelu(a + h) - gelu(a - h)) / (2 * h), 1e-8) << a;
    EXPECT_NEAR(silu_derivative(a), (silu(a + h) - silu(a - h)) / (2 * h), 1e-8) << a;
  }
  EXPECT_EQ(gelu(0.0), 0.0);
  EXPECT_EQ(silu(0.0), 0.0);
}

}  // namespace
}  // namespace moe::ref
