"""torch_baseline.py: what a PyTorch user would run instead of our dropless MoE layer, timed on the
same shapes and routings as moe_bench, so the comparison sits side by side in one GPU run.

Run (on the GPU machine, PyTorch 2.11):  python3 cuda/bench/torch_baseline.py --out torch_baseline.json
    one shape of your own, as moe_bench --shapes:  ... torch_baseline.py --shapes 65536,1024,4096,64,1

Expert FFN y = gelu(x W1) W2 per expert, bf16, forward and forward+backward, timed with CUDA events
(warm-up, median of 20) for: torch._grouped_mm, a Python loop over experts, and one dense GEMM pair
of the same useful FLOPs (4 * rows * D * H, rows = T*K routed rows). The routing counts follow the
same deterministic rule as moe_bench (cuda/bench/routing_counts.h): expert e gets a share
proportional to w_e (uniform: 1, zipf: 1/(e+1)), floor'ed, the remainder to the first experts.
Each forward + backward starts with no .grad on the leaves, so its gradients are written, not added
into earlier ones, as moe_bench's formulations write theirs (accumulating would add a pass over every
expert weight to PyTorch's time). --timing as moe_bench's.
"""
import argparse
import datetime
import json
import statistics
import time

import torch
import torch.nn.functional as F

from routing_counts import routing_counts  # beside this script

SHAPES = [  # T, D, H, E, K  (the reference shapes, as moe_bench --shapes baselines)
    (16384, 1024, 4096, 64, 1),
    (16384, 2048, 8192, 64, 2),
    (8192, 4096, 14336, 8, 2),
]


def time_ms(fn, pipelined, warmup=3, repeat=20, warmup_s=1.0):
    # Warm up for `warmup` runs and at least warmup_s of wall time, as moe_bench does (time_work):
    # an idle GPU runs at a low SM clock for its first half second or so of load. Then, as moe_bench
    # --timing: synced, each run after a synchronize (its time includes the host's work up to its
    # first launch); pipelined, one untimed run and then all of them back to back, an event between
    # each two (each time is the GPU's alone).
    begin = time.perf_counter()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    while time.perf_counter() - begin < warmup_s:
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(repeat + 1)]
    if pipelined:
        fn()
        events[0].record()
        for i in range(repeat):
            fn()
            events[i + 1].record()
        events[-1].synchronize()
        times = [events[i].elapsed_time(events[i + 1]) for i in range(repeat)]
    else:
        times = []
        for _ in range(repeat):
            events[0].record()
            fn()
            events[1].record()
            events[1].synchronize()
            times.append(events[0].elapsed_time(events[1]))
    return statistics.median(times)


def bench_shape(T, D, H, E, K, routing, pipelined):
    rows = T * K
    counts = routing_counts(rows, E, routing)
    offsets = torch.tensor(counts, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    x = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    w1 = (torch.randn(E, D, H, device="cuda", dtype=torch.bfloat16, generator=gen) / D**0.5).requires_grad_()
    w2 = (torch.randn(E, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) / H**0.5).requires_grad_()
    xg = x.clone().requires_grad_()
    dy = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    useful = 4.0 * rows * D * H
    result = {"T": T, "D": D, "H": H, "E": E, "K": K, "routing": routing, "max_count": max(counts)}

    def grouped():
        h = F.gelu(torch._grouped_mm(xg, w1, offs=offsets), approximate="tanh")
        return torch._grouped_mm(h, w2, offs=offsets)

    splits = [int(c) for c in counts]

    def loop():
        outs = []
        for e, part in enumerate(torch.split(xg, splits)):
            outs.append(F.gelu(part @ w1[e], approximate="tanh") @ w2[e])
        return torch.cat(outs)

    dense_w1 = (torch.randn(D, H, device="cuda", dtype=torch.bfloat16, generator=gen) / D**0.5).requires_grad_()
    dense_w2 = (torch.randn(H, D, device="cuda", dtype=torch.bfloat16, generator=gen) / H**0.5).requires_grad_()

    def dense():
        return F.gelu(xg @ dense_w1, approximate="tanh") @ dense_w2

    leaves = (xg, w1, w2, dense_w1, dense_w2)

    def forward_backward(fn):
        # Fresh gradients each run, as moe_bench writes them: with .grad left set, autograd would
        # add every new gradient into it, an extra pass over all expert weights (at D=1024 E=64,
        # about 3 GB of memory traffic) that the layer does not do.
        for leaf in leaves:
            leaf.grad = None
        fn().backward(dy)

    for name, fn in [("torch_grouped_mm", grouped), ("torch_loop", loop), ("dense_cublas", dense)]:
        try:
            with torch.no_grad():
                fwd = time_ms(fn, pipelined)
            fwd_bwd = time_ms(lambda: forward_backward(fn), pipelined)
            result[name] = {
                "forward_ms": fwd,
                "forward_tflops": useful / fwd / 1e9,
                "forward_backward_ms": fwd_bwd,
                "forward_backward_tflops": 3 * useful / fwd_bwd / 1e9,
            }
        except Exception as error:  # report what failed (an API or alignment limit) and go on
            result[name] = {"error": f"{type(error).__name__}: {error}"}
    return result


def parse_shape(text):
    fields = text.split(",")
    if len(fields) != 5 or not all(f.isdigit() and int(f) > 0 for f in fields):
        raise SystemExit(f"--shapes: 'baselines' or five positive integers T,D,H,E,K, not '{text}'")
    T, D, H, E, K = (int(f) for f in fields)
    if K > E:
        raise SystemExit(f"--shapes: K = {K} experts a token cannot exceed E = {E}")
    return T, D, H, E, K


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="torch_baseline.json")
    parser.add_argument("--timing", choices=("synced", "pipelined"), default="synced",
                        help="as moe_bench --timing: each run after a synchronize, or back to back")
    parser.add_argument("--shapes", default="baselines",
                        help="baselines (moe_bench's reference shapes) or one shape T,D,H,E,K, as moe_bench --shapes")
    parser.add_argument("--routing", choices=("both", "uniform", "zipf"), default="both")
    args = parser.parse_args()
    shapes = SHAPES if args.shapes == "baselines" else [parse_shape(args.shapes)]
    routings = ("uniform", "zipf") if args.routing == "both" else (args.routing,)
    results = []
    print(f"{'shape':32s} {'routing':8s} {'grouped_mm':>11s} {'loop':>8s} {'dense':>8s}  (forward TFLOP/s)")
    for T, D, H, E, K in shapes:
        for routing in routings:
            r = bench_shape(T, D, H, E, K, routing, args.timing == "pipelined")
            results.append(r)
            cells = [f"{r[n].get('forward_tflops', float('nan')):8.0f}" for n in ("torch_grouped_mm", "torch_loop", "dense_cublas")]
            print(f"T={T} D={D} H={H} E={E} K={K}".ljust(32), routing.ljust(8), "   ".join(cells), flush=True)
            torch.cuda.empty_cache()
    doc = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "timing": args.timing,
        "gradients": "fresh each forward + backward (.grad = None), as moe_bench writes them",
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
