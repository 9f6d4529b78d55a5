// placement.cpp: E / R experts a rank, and the config's fingerprint (see placement.h).
#include "ep/placement.h"

#include <bit>
#include <stdexcept>
#include <string>

#include "fnv1a.h"  // fnv1a_64_words

namespace moe::dist {

int64_t experts_per_rank(const MoeConfig& config, int ranks) {
  if (ranks < 1 || config.num_experts % ranks != 0) {
    throw std::invalid_argument("expert parallelism places E / R experts on every rank: E = " +
                                std::to_string(config.num_experts) + " is not divisible by R = " +
                                std::to_string(ranks) + " ranks; choose E a multiple of R");
  }
  return config.num_experts / ranks;
}

Placement placement_of(const MoeConfig& config, int ranks, int r) {
  return Placement{r, ranks, config.num_experts, experts_per_rank(config, ranks), config.hidden_dim};
}

uint64_t config_fingerprint(const MoeConfig& c) {
  auto bits = [](double value) { return std::bit_cast<uint64_t>(value); };
  auto word = [](int64_t value) { return static_cast<uint64_t>(value); };
  return fnv1a_64_words({word(c.tokens), word(c.model_dim), word(c.hidden_dim), word(c.num_experts), word(c.top_k),
                         word(c.block_size), static_cast<uint64_t>(c.formulation),
                         static_cast<uint64_t>(c.activation), c.renormalize ? 1u : 0u, c.seed,
                         bits(c.capacity_factor), bits(c.jitter_eps), bits(c.aux_loss_coef), bits(c.z_loss_coef)});
}

}  // namespace moe::dist
