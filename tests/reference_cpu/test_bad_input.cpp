// test_bad_input.cpp: every public entry point of the CPU reference rejects a bad config, a wrong
// shape or a non-finite value with std::invalid_argument whose message names the offending
// argument and value. Run: ctest --test-dir build -R ReferenceBadInput
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "block_sparse.h"
#include "dispatch.h"
#include "init.h"
#include "moe_layer.h"
#include "pregate.h"
#include "router.h"
#include "test_support.h"
#include "topology.h"

namespace moe::ref {
namespace {

using ::testing::HasSubstr;
using testing::invalid_argument_message;
using testing::random_input;
using testing::small_config;

struct Layer {
  MoeConfig config;
  Matrix x;
  MoeWeights weights;
  Matrix dy;
};

Layer make_layer(uint64_t seed, Formulation formulation = Formulation::dropping) {
  Layer layer;
  layer.config = small_config(formulation, Activation::swiglu);
  layer.x = random_input(layer.config.tokens, layer.config.model_dim, seed);
  layer.weights = random_weights(layer.config, seed + 1);
  layer.dy = random_input(layer.config.tokens, layer.config.model_dim, seed + 2);
  return layer;
}

std::string forward_message(const Layer& l) {
  return invalid_argument_message([&] { moe_forward(l.config, l.x, l.weights); });
}

std::string backward_message(const Layer& l, const LayerForward& forward) {
  return invalid_argument_message([&] { moe_backward(l.config, l.x, l.weights, forward, l.dy); });
}

TEST(ReferenceBadInput, ConfigIsValidatedFirst) {
  Layer layer = make_layer(3000);
  layer.config.top_k = 5;  // K > E = 4
  EXPECT_THROW(moe_forward(layer.config, layer.x, layer.weights), std::invalid_argument);
  EXPECT_THAT(forward_message(layer), HasSubstr("top_k (K) = 5"));
  layer.config.top_k = 0;
  EXPECT_THAT(forward_message(layer), HasSubstr("top_k (K) = 0"));
  layer.config.top_k = 2;
  for (double cf : {0.0, -1.5}) {
    layer.config.capacity_factor = cf;
    EXPECT_THROW(moe_forward(layer.config, layer.x, layer.weights), std::invalid_argument);
    std::ostringstream value;
    value << "capacity_factor = " << cf;
    EXPECT_THAT(forward_message(layer), HasSubstr(value.str()));
    // the router and the plan validate too
    EXPECT_THROW(route(layer.config, layer.x, layer.weights.gate_weights), std::invalid_argument);
    EXPECT_THROW(plan_dispatch(layer.config, IndexMatrix::Zero(layer.config.tokens, 2)), std::invalid_argument);
  }
}

TEST(ReferenceBadInput, MismatchedShapesAreNamed) {
  const Layer good = make_layer(3100);
  Layer layer = good;
  layer.x = random_input(7, 6, 3101);
  EXPECT_THROW(moe_forward(layer.config, layer.x, layer.weights), std::invalid_argument);
  EXPECT_EQ(forward_message(layer), "x has shape [7, 6]; expected [T, D] = [7, 5]");
  EXPECT_THAT(invalid_argument_message([&] { route(layer.config, layer.x, layer.weights.gate_weights); }),
              HasSubstr("x has shape [7, 6]"));

  layer = good;
  layer.weights.gate_weights = random_input(5, 3, 3102);
  EXPECT_EQ(forward_message(layer), "gate_weights has shape [5, 3]; expected [D, E] = [5, 4]");

  layer = good;
  layer.weights.w1.pop_back();
  EXPECT_EQ(forward_message(layer), "w1 has 3 matrices; expected one per expert, E = 4");
  layer = good;
  layer.weights.w1[2] = random_input(5, 4, 3103);  // GeLU-sized W1 in a SwiGLU layer
  EXPECT_EQ(forward_message(layer), "w1[2] has shape [5, 4]; expected [D, w1_columns] = [5, 8]");

  layer = good;
  layer.weights.w2.push_back(layer.weights.w2[0]);
  EXPECT_EQ(forward_message(layer), "w2 has 5 matrices; expected one per expert, E = 4");
  layer = good;
  layer.weights.w2[1] = random_input(5, 4, 3104);
  EXPECT_EQ(forward_message(layer), "w2[1] has shape [5, 4]; expected [H, D] = [4, 5]");

  layer = good;
  const LayerForward forward = moe_forward(layer.config, layer.x, layer.weights);
  layer.dy = random_input(6, 5, 3105);
  EXPECT_THROW(moe_backward(layer.config, layer.x, layer.weights, forward, layer.dy), std::invalid_argument);
  EXPECT_EQ(backward_message(layer, forward), "dy has shape [6, 5]; expected [T, D] = [7, 5]");

  // the block-sparse path exists only for dropless
  layer = good;
  EXPECT_THAT(invalid_argument_message([&] {
                moe_backward(layer.config, layer.x, layer.weights, forward, layer.dy, ExpertPath::block_sparse);
              }),
              HasSubstr("dropless"));
}

TEST(ReferenceBadInput, NonFiniteValuesAreNamed) {
  const Layer good = make_layer(3200);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();

  Layer layer = good;
  layer.x(2, 3) = nan;
  EXPECT_THROW(moe_forward(layer.config, layer.x, layer.weights), std::invalid_argument);
  EXPECT_THAT(forward_message(layer), HasSubstr("x[2, 3] = nan"));
  layer.x(2, 3) = -inf;
  EXPECT_THAT(forward_message(layer), HasSubstr("x[2, 3] = -inf"));

  layer = good;
  layer.weights.gate_weights(4, 1) = inf;
  EXPECT_THAT(forward_message(layer), HasSubstr("gate_weights[4, 1] = inf"));

  layer = good;
  layer.weights.w1[3](0, 7) = nan;
  EXPECT_THAT(forward_message(layer), HasSubstr("w1[3][0, 7] = nan"));

  layer = good;
  layer.weights.w2[0](1, 2) = inf;
  EXPECT_THAT(forward_message(layer), HasSubstr("w2[0][1, 2] = inf"));

  layer = good;
  const LayerForward forward = moe_forward(layer.config, layer.x, layer.weights);
  layer.dy(6, 4) = nan;
  EXPECT_THROW(moe_backward(layer.config, layer.x, layer.weights, forward, layer.dy), std::invalid_argument);
  EXPECT_THAT(backward_message(layer, forward), HasSubstr("dy[6, 4] = nan"));

  // pre-gating checks its input like the router does
  layer = good;
  layer.x(0, 0) = inf;
  EXPECT_THAT(invalid_argument_message([&] { pregate(layer.config, layer.x, layer.weights.gate_weights); }),
              HasSubstr("x[0, 0] = inf"));
}

TEST(ReferenceBadInput, PlansTopologiesAndBlockSparseProducts) {
  const Layer layer = make_layer(3300, Formulation::dropless);
  IndexMatrix top = IndexMatrix::Zero(layer.config.tokens, layer.config.top_k);
  top(3, 1) = 4;  // E = 4: expert ids are 0..3
  EXPECT_THAT(invalid_argument_message([&] { plan_dispatch(layer.config, top); }),
              HasSubstr("top_experts[3, 1] = 4"));
  EXPECT_THAT(invalid_argument_message([&] { plan_dispatch(layer.config, IndexMatrix::Zero(7, 3)); }),
              HasSubstr("top_experts has shape [7, 3]; expected [T, K] = [7, 2]"));

  MoeConfig dropping = layer.config;
  dropping.formulation = Formulation::dropping;
  const DispatchPlan dropping_plan = plan_dispatch(dropping, IndexMatrix::Zero(7, 2));
  EXPECT_THAT(invalid_argument_message([&] { make_topology(dropping, dropping_plan); }),
              HasSubstr("formulation is dropping"));

  const DispatchPlan plan = plan_dispatch(layer.config, IndexMatrix::Zero(7, 2));
  const BlockSparseTopology topo = make_topology(layer.config, plan);  // 14 rows, 16 cols
  EXPECT_THAT(invalid_argument_message([&] { sdd(random_input(13, 3, 1), random_input(3, 16, 2), topo); }),
              HasSubstr("sdd: a has shape [13, 3]"));
  EXPECT_THAT(invalid_argument_message([&] { sdd(random_input(14, 3, 1), random_input(3, 15, 2), topo); }),
              HasSubstr("sdd: bm has shape [3, 15]; expected [Kd, N] = [3, 16]"));
  const Matrix blocks = Matrix::Ones(topo.nnz * 2, 2);
  EXPECT_THAT(invalid_argument_message([&] { dsd(topo, Matrix::Ones(3, 2), false, random_input(16, 2, 3)); }),
              HasSubstr("dsd: s_blocks has shape [3, 2]"));
  EXPECT_THAT(invalid_argument_message([&] { dsd(topo, blocks, true, random_input(16, 2, 3)); }),
              HasSubstr("dsd: bm has shape [16, 2]; expected [M, P] with M = 14"));
  EXPECT_THAT(invalid_argument_message([&] { dds(random_input(2, 14, 4), topo, blocks, true); }),
              HasSubstr("dds: a has shape [2, 14]; expected [P, N] with N = 16"));
}

}  // namespace
}  // namespace moe::ref
