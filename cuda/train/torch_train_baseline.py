#!/usr/bin/env python3
"""torch_train_baseline.py: the PyTorch baseline of moe_train's speed, timed in the same call.

A straightforward PyTorch implementation of the same byte-level MoE transformer as moe_train
(cuda/train/, reference_cpu/model.h): token + position embeddings, pre-LayerNorm blocks with causal
multi-head attention (F.scaled_dot_product_attention) and an MoE FFN in every block (softmax
top-K router, load-balancing and z-losses, tokens sorted by expert, experts through
torch._grouped_mm, GeLU), tied output projection, cross-entropy; bf16 autocast, fp32 master
weights, fused AdamW, gradient clipping. `--dense` swaps the MoE FFN for a dense FFN of
H_dense = K*H (the same active FLOPs). Nothing here is tuned: it is what one writes first.

  python3 cuda/train/torch_train_baseline.py                      # the throughput preset, MoE
  python3 cuda/train/torch_train_baseline.py --dense --out r.json  # the dense model
Sizes default to moe_train's "throughput" preset (D=512, L=8, 8 heads, E=16 of H=1024, K=2,
S=256, N=64). Random bytes (the speed does not depend on the text); CUDA events around each step,
warm-up, then --steps steps enqueued back to back with a CUDA event after each
(as moe_train's benchmark), median.
"""
import argparse
import datetime
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Moe(nn.Module):
    def __init__(self, d, h, e, k):
        super().__init__()
        self.e, self.k = e, k
        self.gate = nn.Parameter(torch.randn(d, e) * 0.02)
        self.w1 = nn.Parameter(torch.randn(e, d, h) * 0.02)
        self.w2 = nn.Parameter(torch.randn(e, h, d) * 0.02)

    def forward(self, x):  # x [T, D]
        logits = x.float() @ self.gate.float()
        probs = logits.softmax(-1)
        top_p, top_e = probs.topk(self.k, dim=-1)  # [T, K]
        flat_e = top_e.reshape(-1)
        order = flat_e.argsort(stable=True)
        token_of = order // self.k
        counts = torch.bincount(flat_e, minlength=self.e)
        offsets = counts.cumsum(0, dtype=torch.int32)
        xs = x[token_of].to(torch.bfloat16)
        h = F.gelu(torch._grouped_mm(xs, self.w1.to(torch.bfloat16), offs=offsets), approximate="tanh")
        ys = torch._grouped_mm(h, self.w2.to(torch.bfloat16), offs=offsets)
        weights = top_p.reshape(-1)[order].unsqueeze(1).to(ys.dtype)
        y = torch.zeros_like(x, dtype=ys.dtype).index_add_(0, token_of, ys * weights)
        fraction = counts.float() / flat_e.numel()
        aux = self.e * (fraction * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        return y, 0.01 * aux + 0.001 * z


class Block(nn.Module):
    def __init__(self, d, heads, ffn):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.ffn = ffn

    def forward(self, x):  # [N, S, D]
        n, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(n, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(n, s, d)
        x = x + self.out(a)
        y = self.ln2(x).reshape(n * s, d)
        if isinstance(self.ffn, Moe):
            f, loss = self.ffn(y)
        else:
            f, loss = self.ffn(y), 0.0
        return x + f.view(n, s, d).to(x.dtype), loss


class Model(nn.Module):
    def __init__(self, a):
        super().__init__()
        d = a.model_dim
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(a.seq_len, d)

        def ffn():
            if a.dense:
                return nn.Sequential(nn.Linear(d, a.top_k * a.expert_hidden_dim, bias=False),
                                     nn.GELU(approximate="tanh"),
                                     nn.Linear(a.top_k * a.expert_hidden_dim, d, bias=False))
            return Moe(d, a.expert_hidden_dim, a.num_experts, a.top_k)

        self.blocks = nn.ModuleList(Block(d, a.num_heads, ffn()) for _ in range(a.num_layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, tokens, targets):
        x = self.tok(tokens) + self.pos.weight[: tokens.shape[1]]
        extra = 0.0
        for block in self.blocks:
            x, loss = block(x)
            extra = extra + loss
        logits = self.ln(x) @ self.tok.weight.t()
        return F.cross_entropy(logits.float().reshape(-1, 256), targets.reshape(-1)) + extra


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dim", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--expert-hidden-dim", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dense", action="store_true", help="dense FFN of K*H instead of the MoE layer")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="")
    a = p.parse_args()
    torch.manual_seed(1)
    model = Model(a).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    T = a.batch * a.seq_len

    def step():
        data = torch.randint(0, 256, (a.batch, a.seq_len + 1), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(data[:, :-1], data[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    # As moe_train --benchmark-steps times itself: steps enqueued back to back (no host sync
    # between them, so the host's Python overhead overlaps the GPU's work where it can), an event
    # after each, the time between two events is one step.
    events = [torch.cuda.Event(enable_timing=True) for _ in range(a.steps + 1)]
    events[0].record()
    for i in range(a.steps):
        loss = step()
        events[i + 1].record()
    torch.cuda.synchronize()
    times = [events[i].elapsed_time(events[i + 1]) for i in range(a.steps)]
    assert math.isfinite(loss.item()), "the loss is not finite"
    times.sort()
    median = times[len(times) // 2]
    result = {"device": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "torch": torch.__version__, "model": "dense" if a.dense else "moe", "config": vars(a),
              "tokens_per_step": T, "median_step_ms": median, "min_step_ms": times[0],
              "tokens_per_second": T / (median * 1e-3)}
    print(f"PyTorch {result['model']}: median step {median:.3f} ms (min {times[0]:.3f}), "
          f"{result['tokens_per_second'] / 1e3:.1f}k tokens/s on {result['device']} (torch {torch.__version__})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
