// rank_agreement.cpp: checks that end on every rank together (see rank_agreement.h).
#include "comm/rank_agreement.h"

#include <algorithm>
#include <exception>
#include <string>
#include <vector>

namespace moe::dist {

void check_on_every_rank(Communicator& communicator, std::string_view what,
                         const std::function<void()>& local_check) {
  std::string message;
  try {
    local_check();
  } catch (const std::exception& error) {
    message = error.what();
    if (message.empty()) message = "(an exception without a message)";
  }
  // Messages differ in length: gather the lengths, then every message padded to the longest.
  const std::vector<int64_t> lengths = all_gather<int64_t>(communicator, static_cast<int64_t>(message.size()));
  const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
  if (longest == 0) return;
  std::vector<uint8_t> mine(static_cast<size_t>(longest), 0);
  std::copy(message.begin(), message.end(), mine.begin());
  const std::vector<uint8_t> all = all_gather<uint8_t>(communicator, mine);
  // One entry per distinct message, with the ranks that gave it ("every rank" when all did).
  std::vector<std::pair<std::string, std::vector<int>>> messages;
  for (int p = 0; p < communicator.size(); ++p) {
    if (lengths[p] == 0) continue;
    const auto* text = reinterpret_cast<const char*>(all.data()) + static_cast<size_t>(p) * longest;
    const std::string one(text, static_cast<size_t>(lengths[p]));
    auto same = std::find_if(messages.begin(), messages.end(), [&](const auto& entry) { return entry.first == one; });
    if (same == messages.end()) {
      messages.push_back({one, {p}});
    } else {
      same->second.push_back(p);
    }
  }
  std::string report(what);
  report += ":";
  for (const auto& [text, ranks] : messages) {
    if (communicator.size() > 1 && static_cast<int>(ranks.size()) == communicator.size()) {
      report += " every rank";
    } else {
      report += ranks.size() == 1 ? " rank" : " ranks";
      for (size_t i = 0; i < ranks.size(); ++i) report += (i ? ", " : " ") + std::to_string(ranks[i]);
    }
    report += ": " + text + ";";
  }
  report.pop_back();
  throw std::invalid_argument(report);
}

void check_same_on_every_rank(Communicator& communicator, std::string_view what, uint64_t fingerprint) {
  const std::vector<int64_t> all = all_gather<int64_t>(communicator, static_cast<int64_t>(fingerprint));
  std::string differing;
  for (int p = 1; p < communicator.size(); ++p) {
    if (all[p] != all[0]) differing += (differing.empty() ? "" : ", ") + std::to_string(p);
  }
  if (differing.empty()) return;
  throw std::invalid_argument(std::string(what) + " differ between ranks: rank(s) " + differing +
                              " disagree with rank 0; every rank must pass the same settings");
}

}  // namespace moe::dist
