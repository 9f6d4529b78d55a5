// sim/cluster.cpp: parsing the simulated machine's shape (cluster.h).
#include "sim/cluster.h"

#include <sstream>
#include <stdexcept>

#include "parse_number.h"  // parse_integer

namespace moe::sim {

Cluster parse_cluster(const std::string& text) {
  const std::string allowed =
      "allowed: nodes=N,gpus-per-node=G or ranks=R, with N, G >= 1 and N G <= " + std::to_string(kMaxSimulatedRanks);
  auto refuse = [&](const std::string& why) {
    return std::invalid_argument("--cluster " + text + ": " + why + " (" + allowed + ")");
  };
  Cluster cluster;
  bool ranks_given = false, shape_given = false;
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, ',');) {
    const size_t equals = item.find('=');
    if (equals == std::string::npos) throw refuse("'" + item + "' is not key=value");
    const std::string key = item.substr(0, equals);
    const std::optional<int64_t> value = parse_integer(item.substr(equals + 1));
    if (!value || *value < 1 || *value > kMaxSimulatedRanks) throw refuse("'" + item + "' needs a whole number >= 1");
    if (key == "nodes") {
      cluster.nodes = *value;
      shape_given = true;
    } else if (key == "gpus-per-node") {
      cluster.gpus_per_node = *value;
      shape_given = true;
    } else if (key == "ranks") {
      cluster.gpus_per_node = *value;
      ranks_given = true;
    } else {
      throw refuse("unknown key '" + key + "'");
    }
  }
  if (text.empty()) throw refuse("empty");
  if (ranks_given && shape_given) throw refuse("ranks= goes alone");
  if (cluster.ranks() > kMaxSimulatedRanks) throw refuse("R = " + std::to_string(cluster.ranks()) + " is too many");
  return cluster;
}

std::string describe(const Cluster& cluster) {
  return std::to_string(cluster.nodes) + (cluster.nodes == 1 ? " node x " : " nodes x ") +
         std::to_string(cluster.gpus_per_node) + (cluster.gpus_per_node == 1 ? " GPU" : " GPUs") +
         " (R = " + std::to_string(cluster.ranks()) + ")";
}

}  // namespace moe::sim
