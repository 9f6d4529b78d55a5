// rank_agreement.h: checks that end on every rank together. A check that throws on one rank only
// leaves its peers waiting in the next collective, so a distributed layer first lets every rank
// check its own inputs, then shares the outcomes (one all-gather), and every rank throws the same
// message, naming the ranks that failed: a clear error on every rank, never a hang.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>

#include "comm/communicator.h"

namespace moe::dist {

// Runs local_check here; if it threw on any rank, every rank throws std::invalid_argument
// "<what>: rank p: <its message>; ranks q, s: <theirs>" (each distinct message once, with the ranks
// that gave it, in order; "every rank: <message>" when all of several ranks gave the same). Collective.
void check_on_every_rank(Communicator& communicator, std::string_view what,
                         const std::function<void()>& local_check);

// Every rank passes a fingerprint of what must be equal everywhere (a hash of its settings); if any
// differs from rank 0's, every rank throws std::invalid_argument naming those ranks. Collective.
void check_same_on_every_rank(Communicator& communicator, std::string_view what, uint64_t fingerprint);

}  // namespace moe::dist
