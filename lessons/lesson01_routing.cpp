// lesson01_routing.cpp: Lesson 01, routing. How a router picks experts (softmax, top-K), what
// routing imbalance looks like on text-like data, and how the load-balancing loss fixes it. The
// router decides what every later lesson computes and how unevenly, so it comes first.
// Read lessons/01_routing.md beside it.
//
// Build and run:  ./moe build && build/lessons/lesson01_routing [--out runs/lesson01_routing]
//
// Everything runs on the CPU reference (moe::ref, double precision). Dimension legend:
// T tokens, D model width, H expert hidden width, E experts, K top-k.
#include <algorithm>
#include <cmath>
#include <iostream>
#include <sstream>

#include "lesson_support.h"           // options, zipf_tokens, Table, load_stats
#include "reference_cpu/moe_layer.h"  // moe_forward, moe_backward
#include "init.h"                     // random_matrix, random_weights
#include "reference_cpu/router.h"     // route

using namespace moe;
using moe::lessons::Table;

namespace {

// Mean routing entropy over tokens, in units of log(E): 1 = the router cannot tell experts apart,
// 0 = every token is certain of its expert.
double routing_entropy(const ref::Matrix& probs) {  // [T, E]
  double total = 0;
  for (int64_t t = 0; t < probs.rows(); ++t) {
    for (int64_t e = 0; e < probs.cols(); ++e) {
      const double p = probs(t, e);
      if (p > 0) total -= p * std::log(p);
    }
  }
  return total / static_cast<double>(probs.rows()) / std::log(static_cast<double>(probs.cols()));
}

// ---- 1. the router on two kinds of input ----

struct RouterOnInputs {
  bool counts_ok = true;               // every plan's counts sum to T * K
  double aux_random = 0, aux_text = 0;  // the aux loss at the lesson's K
  ref::RouterOutput text_routing;       // zipf text at the lesson's K
};

RouterOnInputs show_router_on_inputs(RunWriter& writer, const MoeConfig& config, const ref::Matrix& gate,
                                     const ref::Matrix& random_x, const ref::Matrix& text_x) {
  Table routing_table("Table 1: the same router on random tokens and on text-like (Zipf) tokens",
                      {"input", "K", "max/mean load", "CV of load", "idle experts", "aux loss",
                       "z loss", "entropy/log E"});
  RouterOnInputs result;
  for (const auto& [name, x] : {std::pair<std::string, const ref::Matrix*>{"random", &random_x},
                                {"zipf text", &text_x}}) {
    for (int64_t k : {int64_t{1}, int64_t{2}}) {
      MoeConfig c = config;
      c.top_k = k;
      const ref::RouterOutput routing = ref::route(c, *x, gate);
      const ref::DispatchPlan plan = ref::plan_dispatch(c, routing.top_experts);
      int64_t routed = 0;
      for (int32_t n : plan.tokens_per_expert) routed += n;
      result.counts_ok = result.counts_ok && routed == c.tokens * c.top_k;
      const auto stats = lessons::load_stats(plan.tokens_per_expert);
      routing_table.add_row({name, k, stats.max_over_mean, stats.coefficient_of_variation,
                             stats.idle_experts, routing.aux_loss, routing.z_loss,
                             routing_entropy(routing.probs)});
      if (k == config.top_k) {
        if (name == "random") result.aux_random = routing.aux_loss;
        else { result.aux_text = routing.aux_loss; result.text_routing = routing; }
      }
    }
  }
  lessons::show(writer, routing_table);
  std::cout << "  aux loss = E * sum_e f_e * P_e: f_e = share of routed slots on expert e, P_e = mean\n"
               "  router probability of e. Uniform routing gives exactly 1; skew pushes it up.\n";
  return result;
}

// ---- 2. a picture of the skew ----

void draw_skew(const MoeConfig& config, const ref::RouterOutput& text_routing) {
  const ref::DispatchPlan plan = ref::plan_dispatch(config, text_routing.top_experts);
  const double most = *std::max_element(plan.tokens_per_expert.begin(), plan.tokens_per_expert.end());
  const double mean = static_cast<double>(config.tokens * config.top_k) / config.num_experts;
  std::cout << "\nTokens per expert on zipf text (K=2); '|' marks the mean load " << mean << "\n";
  for (int64_t e = 0; e < config.num_experts; ++e) {
    std::string b = lessons::bar(plan.tokens_per_expert[e], most, 50);
    const auto mean_col = static_cast<size_t>(std::lround(50 * mean / most));
    if (b.size() <= mean_col) b.resize(mean_col, ' '), b += '|';
    std::cout << "  expert " << (e < 10 ? " " : "") << e << " " << std::setw(6)
              << plan.tokens_per_expert[e] << " " << b << "\n";
  }
}

// ---- 3. training the router on the load-balancing loss alone ----

struct Balancing {
  double first_max_over_mean = 0, last_max_over_mean = 0, first_aux = 0, last_aux = 0;
};

// With dy = 0 the layer's objective is aux_loss_coef * aux + z_loss_coef * z, so plain gradient
// descent on the gate weights shows what the balancing loss does on its own: it lowers the mean
// probability P_e of the busy experts until tokens move elsewhere. (In a real model it competes
// with the language-model loss, which is why its coefficient is small, ~0.01.)
Balancing train_on_balancing_loss(RunWriter& writer, const MoeConfig& config, const ref::Matrix& gate,
                                   const ref::Matrix& text_x, uint64_t seed) {
  MoeConfig train_config = config;
  train_config.aux_loss_coef = 1.0;
  train_config.z_loss_coef = 1e-3;
  ref::MoeWeights weights = ref::random_weights(train_config, seed + 1);
  weights.gate_weights = gate;
  const ref::Matrix no_gradient = ref::Matrix::Zero(config.tokens, config.model_dim);  // dy = 0
  const double learning_rate = 2.0;
  const int steps = 60;
  Table balance_table("Table 2: gradient descent on the load-balancing loss alone (zipf text, K=2)",
                      {"step", "aux loss", "max/mean load", "CV of load", "idle experts"});
  Balancing b;
  for (int step = 0; step <= steps; ++step) {
    const ref::LayerForward forward = ref::moe_forward(train_config, text_x, weights);
    const auto stats = lessons::load_stats(forward.plan.tokens_per_expert);
    writer.append(to_event(RoutingEvent{.step = step, .layer = 0,
                                        .tokens_per_expert = lessons::as_int64(forward.plan.tokens_per_expert),
                                        .dropped_per_expert = {}, .capacity = std::nullopt,
                                        .tokens_per_expert_by_genre = {}}));
    writer.append(step_event(step, {{"aux_loss", forward.aux_loss}, {"z_loss", forward.z_loss},
                                    {"max_over_mean_load", stats.max_over_mean}}));
    if (step == 0) b.first_max_over_mean = stats.max_over_mean, b.first_aux = forward.aux_loss;
    b.last_max_over_mean = stats.max_over_mean;
    b.last_aux = forward.aux_loss;
    if (step % 10 == 0) {
      balance_table.add_row({step, forward.aux_loss, stats.max_over_mean,
                             stats.coefficient_of_variation, stats.idle_experts});
    }
    if (step == steps) break;
    const ref::LayerGradients gradients =
        ref::moe_backward(train_config, text_x, weights, forward, no_gradient);
    weights.gate_weights -= learning_rate * gradients.gate_weights;
  }
  lessons::show(writer, balance_table);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  const auto options = lessons::parse_options(argc, argv, "lesson01_routing", "runs/lesson01_routing");
  std::mt19937_64 generator(options.seed);

  MoeConfig config;
  config.tokens = 8192;    // T
  config.model_dim = 64;   // D
  config.hidden_dim = 32;  // H (the experts' width does not matter to routing; kept small)
  config.num_experts = 16; // E
  config.top_k = 2;        // K
  config.block_size = 16;
  config.formulation = Formulation::dropless;

  auto writer = lessons::create_lesson_run(options, "lesson01_routing", "01", config);

  std::cout << "Lesson 01: routing. T=" << config.tokens << " tokens of width D=" << config.model_dim
            << ", E=" << config.num_experts << " experts, top-K=" << config.top_k << "\n";

  // The router and its two inputs. Random tokens are what a freshly initialised model sees in theory; text is Zipf-distributed:
  // a few token types ("the", ",", "of") make up much of every batch, and identical tokens always
  // go to the same experts.
  const ref::Matrix gate = ref::random_matrix(config.model_dim, config.num_experts, generator,
                                              3.0 / std::sqrt(static_cast<double>(config.model_dim)));
  const ref::Matrix random_x = ref::random_matrix(config.tokens, config.model_dim, generator);
  const ref::Matrix text_x = lessons::zipf_tokens(config.tokens, config.model_dim, 1000, 1.1, generator);

  const RouterOnInputs inputs = show_router_on_inputs(writer, config, gate, random_x, text_x);
  draw_skew(config, inputs.text_routing);
  const Balancing b = train_on_balancing_loss(writer, config, gate, text_x, options.seed);

  // ---- verdict ----
  const bool skew_seen = inputs.aux_text > inputs.aux_random;
  const bool balanced = b.last_max_over_mean < b.first_max_over_mean && b.last_aux < b.first_aux;
  const bool pass = inputs.counts_ok && skew_seen && balanced;
  std::ostringstream message;
  message << std::setprecision(3) << "counts sum to T*K: " << (inputs.counts_ok ? "yes" : "NO")
          << "; aux loss random=" << inputs.aux_random << " < zipf=" << inputs.aux_text
          << "; balancing: max/mean load " << b.first_max_over_mean << " -> " << b.last_max_over_mean
          << ", aux " << b.first_aux << " -> " << b.last_aux;
  return lessons::finish_lesson(writer, "lesson01_routing", options, pass, message.str());
}
