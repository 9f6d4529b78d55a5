// sim/worked_example.h: a calibration of round numbers, small enough to add up on paper: lesson 09's
// worked example and the simulator's hand-computed tests use it.
//
// The "GPU" it describes: a layer of T = 1000 tokens, D = 100, H = 200, E = 2, K = 1, B = 1 (no
// padding) whose one-GPU step is 1000 us, its phases at d = 1 summing to 546 us (454 us unnamed);
// experts of 300 us at d = 1 and 400 us at d = 2 (so A = 200 us of products and B = 100 us a
// launch for its 2 experts: 8 us an expert, their bytes at HBM speed, and 84 us a launch); an
// NVLink all-to-all of 10 us a MB (bytes a rank, 1 to 2 MB, 10 us below), a count exchange of 7 us;
// a NIC of 10 GB/s with 5 us latency and 1 us a peer; HBM copies at 40 GB/s.
#pragma once

#include <cstdint>

#include "sim/calibration.h"  // Calibration
#include "sim/cost_model.h"   // LayerSpec

namespace moe::sim {

Calibration worked_example_calibration();
LayerSpec worked_example_layer(int64_t experts);  // T = 1000, D = 100, H = 200, K = 1, B = 1

}  // namespace moe::sim
