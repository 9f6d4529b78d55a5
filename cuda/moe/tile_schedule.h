// tile_schedule.h: which tiles, and which k-steps of them, each worker of the persistent
// warp-specialized kernel computes (block_sparse_wgmma_ws.cuh): rounds of whole tiles, then a
// stream-K tail. Plain arithmetic, the same on the host and the device, so that tests check it on
// the CPU (tests/cuda/test_block_sparse.cpp, TileSchedule*).
//
// Why a tail. A persistent kernel runs `workers` CTAs (or clusters of CTAs) at once, and every tile
// of the DSD takes the same k-steps. With U tiles, the last round has r = U % workers of them: at
// T=16384 D=2048 E=64 K=2 under Zipf routing the forward's DSD has 1136 tiles (of pairs of block
// rows) for 66 clusters, 17.2 rounds, so its 18th round keeps 14 of the 66 clusters busy, and the
// product takes 18 rounds' time for 17.2 rounds' work.
// Stream-K (Osama, Merrill, Cecka, Garland, Owens: "Stream-K: Work-centric Parallel Decomposition
// for Dense Matrix Multiplication on the GPU", PPoPP 2023) hands out k-steps instead of tiles. Here
// the whole rounds go tile by tile, in the kernel's usual order, and only the last r tiles are one
// run of r x k_steps k-steps, cut into equal ranges, one per worker of the first min(workers, 2 r)
// (the paper's "data-parallel + one-tile stream-K" hybrid): the product then takes U / workers
// rounds' time, or half a round more where r is small, rather than a whole round more.
// A tile that a range boundary cuts is computed in parts by two or three workers (a range is at
// least half a tile long, and shorter than a tile), whose partial sums meet in global memory, where
// the last to arrive adds them up and stores the tile (block_sparse_wgmma_ws.cuh, ws_stream_k_meet).
// Ranges of at least half a tile keep that sum to one or two partial sums of 16 KB a warp.
// Why only the last r tiles: in the whole rounds, the CTAs that multiply one chunk of an expert's
// weights (the tiles of its block rows at the same columns) run side by side at the same k-step, so
// the chunk comes from HBM once and from the L2 for the rest. A k-step cut out of step moves them
// apart, and each reads the chunk on its own: a tail of a round and a half (the paper's two-tile
// form) makes the forward's DSD at T=16384 D=1024 E=64 a third slower on an H200 (part 1 of the
// file below).
// Where it is taken: the DSDs in pairs of block rows (block_sparse.cu, launch_ws_pairs). Measured
// on an H200 at locked base clocks, against no tail in the same run (notebooks_data/bench/
// ncu_stream_k_h200_2026-11-22.txt): the forward's DSD 1.91 -> 1.86 ms and the backward's 1.91 -> 1.84 at
// T=16384 D=2048 E=64 K=2 under Zipf routing (14 of 66 clusters in the last round), 1.64 -> 1.61 ms
// uniform, 2.78 -> 2.74 ms at T=8192 D=4096 E=8 K=2 uniform; one CTA a tile at D=1024 (4.7 and 3.9
// rounds) lost even with this tail, 0.321 -> 0.336 ms (Zipf) and 0.268 -> 0.300 (uniform), and so
// did that DSD in pairs (0.307 -> 0.325 and 0.247 -> 0.256, part 6): it waits on HBM for W2, so the
// L2 sharing lost in the cut tiles costs more than the idle SMs.
// At the card's own clock (moe_bench, same file, part 5) the gain is within the spread but for the
// forward + backward at D=2048 Zipf (1%); at D=4096 uniform the forward may lose up to 2%.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOE_HOST_DEVICE __host__ __device__
#else
#define MOE_HOST_DEVICE
#endif

namespace moe::cuda {

// One piece of a worker's work: k-steps [k_begin, k_end) of tile `tile` (in the kernel's tile order),
// which is tail tile `tail_tile` (-1: a tile of the whole rounds). A whole tile this worker stores; a
// part of a cut one (cut()) meets the others (TileSchedule::parts, part_slot).
struct TileSegment {
  int tile = 0, k_begin = 0, k_end = 0, tail_tile = -1;
  MOE_HOST_DEVICE bool cut(int k_steps) const { return k_begin > 0 || k_end < k_steps; }
};

class TileSchedule {
 public:
  // `tiles` tiles of `k_steps` k-steps each over `workers` workers; this is worker `worker`'s share.
  // Without stream_k, or with no partial last round: whole tiles worker, worker + workers, ...
  MOE_HOST_DEVICE TileSchedule(int tiles, int workers, int worker, int k_steps, bool stream_k)
      : workers_(workers), k_steps_(k_steps), round_tiles_(tiles), next_tile_(worker) {
    if (stream_k && k_steps > 1 && tiles % workers != 0) {
      round_tiles_ = tiles / workers * workers;
      const int tail_tiles = tiles - round_tiles_;
      tail_workers_ = 2 * tail_tiles < workers ? 2 * tail_tiles : workers;
      tail_steps_ = tail_tiles * k_steps;  // < workers x k_steps
      next_step_ = start(worker < tail_workers_ ? worker : tail_workers_);
      end_step_ = start(worker < tail_workers_ ? worker + 1 : tail_workers_);
    }
  }
  // Whether the last tiles are shared out by k-steps.
  MOE_HOST_DEVICE bool has_tail() const { return tail_steps_ > 0; }

  // The next piece of this worker's work; false when there is none.
  MOE_HOST_DEVICE bool next(TileSegment& segment) {
    if (next_tile_ < round_tiles_) {
      segment = {next_tile_, 0, k_steps_, -1};
      next_tile_ += workers_;
      return true;
    }
    if (next_step_ >= end_step_) return false;
    const int tail_tile = next_step_ / k_steps_, tile_start = tail_tile * k_steps_, tile_end = tile_start + k_steps_;
    segment.tile = round_tiles_ + tail_tile;
    segment.tail_tile = tail_tile;
    segment.k_begin = next_step_ - tile_start;
    segment.k_end = (end_step_ < tile_end ? end_step_ : tile_end) - tile_start;
    next_step_ = tile_start + segment.k_end;
    return true;
  }

  // The workers with a part of tail tile `tail_tile`: first_worker .. last_worker, those among them
  // whose range is not empty (has_steps); `parts` of them.
  MOE_HOST_DEVICE int first_worker(int tail_tile) const { return worker_at(tail_tile * k_steps_); }
  MOE_HOST_DEVICE int last_worker(int tail_tile) const { return worker_at((tail_tile + 1) * k_steps_ - 1); }
  MOE_HOST_DEVICE bool has_steps(int w) const { return start(w) < start(w + 1); }
  MOE_HOST_DEVICE int parts(int tail_tile) const {
    int count = 0;
    for (int w = first_worker(tail_tile), last = last_worker(tail_tile); w <= last; ++w) count += has_steps(w);
    return count;
  }
  // Where worker w leaves its part of tail tile `tail_tile`: slot 2 w for the first piece of its
  // range, 2 w + 1 for the second (a range shorter than a tile touches at most two tiles).
  MOE_HOST_DEVICE int part_slot(int w, int tail_tile) const {
    return 2 * w + (start(w) >= tail_tile * k_steps_ ? 0 : 1);
  }

 private:
  // The first tail k-step of tail worker w (w = tail_workers_: the end): as even as integers allow.
  MOE_HOST_DEVICE int start(int w) const {
    return static_cast<int>(static_cast<int64_t>(tail_steps_) * w / tail_workers_);
  }
  // The worker whose range holds tail k-step p: the last w with start(w) <= p.
  MOE_HOST_DEVICE int worker_at(int p) const {
    int w = static_cast<int>((static_cast<int64_t>(p) + 1) * tail_workers_ / tail_steps_);  // start(w) <= p + 1 ...
    while (w > 0 && start(w) > p) --w;                                                    // ... within one
    while (w + 1 < tail_workers_ && start(w + 1) <= p) ++w;
    return w;
  }

  int workers_, k_steps_;
  int round_tiles_;                   // tiles [0, round_tiles_) go whole, one per worker a round
  int next_tile_;                     // this worker's next whole tile
  int tail_workers_ = 1;              // the workers that share the tail: min(workers, 2 tail tiles)
  int tail_steps_ = 0;                // the tail's k-steps: (tiles - round_tiles_) x k_steps
  int next_step_ = 0, end_step_ = 0;  // this worker's range of them
};

}  // namespace moe::cuda

#undef MOE_HOST_DEVICE
