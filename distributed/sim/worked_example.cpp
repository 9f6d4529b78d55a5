// sim/worked_example.cpp: the round-number calibration (worked_example.h).
#include "sim/worked_example.h"

#include <string>

namespace moe::sim {

Calibration worked_example_calibration() {
  static const std::string kName = "worked example (round numbers)";
  Calibration c;
  c.device = kName;
  c.date = kName;
  c.gpus_measured = 2;
  c.layer = {1000, 100, 200, 2, 1, 1};
  c.layer_step_us = {{1, 1000.0}, {2, 1100.0}};
  c.layer_phases_us[1] = {{"ep_route", 10},           {"ep_count_exchange", 15},  {"ep_permute", 20},
                          {"ep_dispatch", 8},         {"ep_experts", 300},        {"ep_combine_exchange", 8},
                          {"ep_combine", 30},         {"ep_combine_backward", 40}, {"ep_router_backward", 50},
                          {"ep_router_all_reduce", 5}, {"sgd_experts", 60}};
  c.layer_phases_us[2] = c.layer_phases_us[1];
  c.layer_phases_us[2]["ep_experts"] = 400;
  c.all_to_all.push_back({2, Curve{{1e6, 2e6}, {10, 20}}});
  c.count_exchange_us[2] = 7;
  c.device_copy_gbs = 40;
  c.inter_node = {10.0, 1.0, 5.0, 1.0, "round numbers for the worked example"};
  return c;
}

LayerSpec worked_example_layer(int64_t experts) {
  return {.tokens_per_rank = 1000, .model_dim = 100, .hidden_dim = 200, .experts = experts, .top_k = 1, .block_size = 1};
}

}  // namespace moe::sim
