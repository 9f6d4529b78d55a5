#!/usr/bin/env python3
"""torch_attention_baseline.py: PyTorch's causal attention at attention_bench's shape, timed the same way.

Two rows, forward and backward each, bf16:
  sdpa_core   F.scaled_dot_product_attention(q, k, v, is_causal=True) on [N, heads, S, d] views of
              a [T, 3D] projection, as torch_train_baseline.py's model calls it (PyTorch picks its
              fused kernel, FlashAttention-2 or cuDNN's, on Hopper)
  layer       the whole attention layer: qkv projection, the core, output projection
CUDA events around each run, --warmup untimed runs then --repeat timed runs per round, fresh
random inputs each round, the median of rounds x repeat; TFLOP/s on the core's causal FLOPs as
attention_bench counts them.

  python3 cuda/bench/torch_attention_baseline.py [--batch 64 --seq-len 256 --model-dim 512 --heads 8] [--out r.json]
"""
import argparse
import datetime
import json
import statistics

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--model-dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="")
    a = p.parse_args()
    n, s, dm, h = a.batch, a.seq_len, a.model_dim, a.heads
    d = dm // h
    dev, bf = "cuda", torch.bfloat16
    w_qkv = (torch.randn(dm, 3 * dm, device=dev) / dm ** 0.5).to(bf).requires_grad_()
    w_out = (torch.randn(dm, dm, device=dev) / dm ** 0.5).to(bf).requires_grad_()

    def heads(t):  # [N*S, D] -> [N, heads, S, d]
        return t.view(n, s, h, d).transpose(1, 2)

    def core(qkv):
        q, k, v = qkv.split(dm, dim=-1)
        return F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)

    state = {}

    def fresh():
        state["x"] = torch.randn(n * s, dm, device=dev, dtype=bf, requires_grad=True)
        state["qkv"] = (state["x"].detach() @ w_qkv.detach()).requires_grad_()
        state["d_core"] = torch.randn(n, h, s, d, device=dev, dtype=bf)
        state["d_out"] = torch.randn(n * s, dm, device=dev, dtype=bf)
        state["core_out"] = core(state["qkv"])
        state["layer_out"] = layer(state["x"])

    def layer(x):
        return core(x @ w_qkv).transpose(1, 2).reshape(n * s, dm) @ w_out

    rows = {
        "sdpa_core_forward": lambda: core(state["qkv"]),
        "sdpa_core_backward": lambda: state["core_out"].backward(state["d_core"], retain_graph=True),
        "layer_forward": lambda: layer(state["x"]),
        "layer_backward": lambda: state["layer_out"].backward(state["d_out"], retain_graph=True),
    }
    times = {name: [] for name in rows}
    for _ in range(a.rounds):
        fresh()
        for name, run in rows.items():
            with torch.no_grad() if name.endswith("forward") else torch.enable_grad():
                for _ in range(a.warmup):
                    run()
                events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(a.repeat)]
                for start, end in events:
                    start.record()
                    run()
                    end.record()
                torch.cuda.synchronize()
                times[name] += [start.elapsed_time(end) for start, end in events]

    forward_gflop = n * h * 2.0 * 2.0 * d * s * (s + 1) / 2.0 / 1e9
    out = {"program": "torch_attention_baseline", "device": torch.cuda.get_device_name(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "torch": torch.__version__,
           "shape": {"batch": n, "seq_len": s, "model_dim": dm, "heads": h, "head_dim": d}, "rows": []}
    print(f"torch_attention_baseline on {out['device']}, {out['date']}, torch {torch.__version__}: "
          f"N={n} S={s} D={dm} heads={h}")
    print(f"{'row':22s} {'median ms':>10s} {'min ms':>10s} {'core TFLOP/s':>14s}")
    for name, t in times.items():
        gflop = forward_gflop * (2.5 if name.endswith("backward") else 1.0)
        ms = statistics.median(t)
        print(f"{name:22s} {ms:10.4f} {min(t):10.4f} {gflop / ms:14.1f}")
        out["rows"].append({"name": name, "median_ms": ms, "min_ms": min(t), "core_tflops": gflop / ms})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
