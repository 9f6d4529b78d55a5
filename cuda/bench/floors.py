"""floors.py: the two numbers first. For each shape and routing of a moe_bench result file, the time
the dropless forward and the dense forward could not go below: their multiply-adds at the GPU's
measured matrix rate, and the bytes they must move through HBM at its measured bandwidth. Beside
them, the measured times, so that one reads how far each side is from its own floors and which
floor binds.

Run:  python3 cuda/bench/floors.py notebooks_data/bench/moe_bench_h200_2026-11-22.json
      (--tflops and --gbps: the ceilings; defaults are the H200 figures of notebooks_data/bench/README.md's anchor table,
      796 TFLOP/s bf16 from cuBLAS and 4183 GB/s device-to-device)

What is counted, forward only, bf16 (2 bytes), rows = T*K routed rows, counts by moe_bench's rule
(routing_counts below, as cuda/bench/routing_counts.h):
- dropless FLOPs: the rows each product multiplies, padding included: the DSD every expert's count
  rounded up to B = 128, the SDD the same but a last block row with 64 routed rows or fewer as 64
  (its half-row tiles, cuda/moe/block_sparse_wgmma_ws.cuh);
- dropless bytes: x read once (T*K rows of D), W1 and W2 read once (E x D x H each), the SDD's two
  outputs written (pre-activation and GeLU, padded rows x H), the GeLU read by the DSD, y written;
- dense FLOPs: 4 rows D H; dense bytes: x, one expert's W1 and W2, the pre-activation written, read
  and the GeLU written by the elementwise pass, the GeLU read, y written (what moe_bench's dense
  cuBLAS runs).
Each product also reads its operands many times through the L2; those reads are not in the floor.
The DSD's padded rows are checked against the plan moe_bench built (computed_rows in the file).
"""
import argparse
import json
import math

from routing_counts import routing_counts  # beside this script

BLOCK = 128


def padded_rows(counts, half_rows):
    rows = 0
    for n in counts:
        if n == 0:
            continue
        last = n % BLOCK
        rows += (n // BLOCK) * BLOCK
        if last:
            rows += BLOCK // 2 if half_rows and last <= BLOCK // 2 else BLOCK
    return rows


def floors(shape, routing, tflops, gbps):
    T, D, H, E, K = (shape[k] for k in ("T", "D", "H", "E", "K"))
    rows = T * K
    counts = routing_counts(rows, E, routing)
    sdd_rows, dsd_rows = padded_rows(counts, True), padded_rows(counts, False)
    ours_flop = 2.0 * sdd_rows * D * H + 2.0 * dsd_rows * H * D
    ours_bytes = 2.0 * (rows * D + 2 * E * D * H + 2 * sdd_rows * H + dsd_rows * H + dsd_rows * D)
    dense_flop = 4.0 * rows * D * H
    dense_bytes = 2.0 * (rows * D + 2 * D * H + 4 * rows * H + rows * H + rows * D)
    ms = lambda flop, byte: (flop / (tflops * 1e12) * 1e3, byte / (gbps * 1e9) * 1e3)
    return sdd_rows, dsd_rows, ms(ours_flop, ours_bytes), ms(dense_flop, dense_bytes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result", help="a moe_bench JSON file")
    parser.add_argument("--tflops", type=float, default=796.0, help="bf16 matrix rate, TFLOP/s")
    parser.add_argument("--gbps", type=float, default=4183.0, help="HBM bandwidth, GB/s")
    args = parser.parse_args()
    try:
        with open(args.result) as f:
            doc = json.load(f)
        doc["results"], doc["device"]["name"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"floors.py: {args.result} is not a readable moe_bench result file ({error})")
    # The floors model GeLU's two products; a file with SwiGLU rows (--activation) keeps its GeLU rows here.
    doc["results"] = [r for r in doc["results"] if r.get("activation", "gelu") == "gelu"]
    measured = {}
    for r in doc["results"]:
        key = (json.dumps(r["shape"], sort_keys=True), r["routing"], r["formulation"])
        measured[key] = r["forward_ms"]
    print(f"{doc['device']['name']}, "
          f"{doc.get('date_utc', '')}; ceilings {args.tflops:.0f} TFLOP/s, {args.gbps:.0f} GB/s; forward, ms")
    print(f"{'shape':30s} {'routing':8s} {'padding sdd/dsd':>16s} | {'ours: flop':>10s} {'bytes':>6s} "
          f"{'measured':>8s} {'x max':>6s} | {'dense: flop':>11s} {'bytes':>6s} {'measured':>8s} {'x max':>6s}")
    for r in doc["results"]:
        if r["formulation"] != "block_sparse_B128":
            continue
        shape, routing = r["shape"], r["routing"]
        dense = measured.get((json.dumps(shape, sort_keys=True), routing, "dense_cublas"), math.nan)
        rows = shape["T"] * shape["K"]
        sdd_rows, dsd_rows, (of, ob), (df, db) = floors(shape, routing, args.tflops, args.gbps)
        if r.get("computed_rows") not in (None, dsd_rows):  # the padding model against the GPU's plan
            raise SystemExit(f"floors.py: {shape} {routing}: {dsd_rows} padded rows here, but moe_bench's plan "
                             f"computed {r['computed_rows']}: the counts rule or B differs from this run's")
        name = "T={T} D={D} H={H} E={E} K={K}".format(**shape)
        print(f"{name:30s} {routing:8s} {sdd_rows / rows - 1:7.1%} /{dsd_rows / rows - 1:6.1%} | "
              f"{of:10.3f} {ob:6.3f} {r['forward_ms']:8.3f} {r['forward_ms'] / max(of, ob):6.2f} | "
              f"{df:11.3f} {db:6.3f} {dense:8.3f} {dense / max(df, db):6.2f}")


if __name__ == "__main__":
    main()
