#!/usr/bin/env python3
"""torch_offload_baseline.py: offload_bench's decoding model and four of its expert modes written the
straightforward way in PyTorch eager, timed the same way, so that offload_bench's step times stand
beside PyTorch's measured in the same device call.

The model is offload_bench's (cuda/bench/offload_bench.cpp), with random bf16 weights:
  switch  D=768, 12 blocks, MoE in every other block (blocks 1, 3, ..., 11), E=64, top-1, H=3072,
          12 heads, dense FFN H=3072
  large   D=4096, 4 blocks, every block MoE, E=8, top-2, H=14336, 32 heads
Pre-LN blocks (LayerNorm, multi-head causal attention over a KV cache, LayerNorm, GeLU FFN or MoE),
a byte vocabulary of 256 tied to the output, learned positions. Each MoE block's router picks the
top-K experts of softmax(x W_g); each token's output is the chosen experts' outputs weighted by
their probabilities renormalized over the K.

The modes, as a PyTorch user would write them:
  gpu_only      every expert on the GPU; per MoE block a loop over the experts the batch chose
  on_demand     the experts in pinned host memory; a GPU cache of C expert slots shared by all
                blocks, least recently used evicted; a block copies its missing experts on the
                compute stream (non_blocking from pinned memory) before computing
  prefetch_all  every expert of the next MoE block copied on a copy stream while this block
                computes, into the other of two buffers of E experts
  pregated      the pre-gated model (MoE block m_j's router reads m_{j-1}'s LayerNorm output, as
                ModelGpuConfig::pregated): at m_{j-1} the experts of m_j are chosen and their
                missing ones copied into the cache on a copy stream; m_0 copies on demand
The cache holds C = max(2 x what a decode step needs, what the prompt needs) experts, as
offload_bench's --cache-factor 2 (a step needs min(E, N K) of a block).

Each (scale, batch, mode): N prompts of --prompt-bytes random bytes run through the decoder one
position at a time, again and again for at least a second (the clocks up, the allocator warm), then
once more, then --warmup decode steps, then --steps timed steps, each between two CUDA events on the
compute stream, greedy bytes. The step time is the median. Every mode runs --rounds times, the
modes in turn; the table gives the lower of a mode's round medians, the JSON every round.

Run:  python3 cuda/bench/torch_offload_baseline.py [--scales switch,large] [--batches 1,8]
          [--modes gpu_only,on_demand,prefetch_all,pregated] [--out FILE.json]
Needs PyTorch with CUDA; prints one line per run and a table, and writes the JSON with --out.
"""
import argparse
import collections
import datetime
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SCALES = {
    "switch": dict(d=768, layers=12, heads=12, experts=64, top_k=1, hidden=3072, dense_hidden=3072, every_other=True),
    "large": dict(d=4096, layers=4, heads=32, experts=8, top_k=2, hidden=14336, dense_hidden=14336, every_other=False),
}
MODES = ("gpu_only", "on_demand", "prefetch_all", "pregated")
VOCAB = 256


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scales", default="switch,large")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--prompt-bytes", type=int, default=8)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--cache-factor", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="")
    a = p.parse_args()
    a.scales = a.scales.split(",")
    a.batches = [int(b) for b in a.batches.split(",")]
    a.modes = a.modes.split(",")
    for s in a.scales:
        if s not in SCALES:
            p.error(f"--scales: {s}; allowed: {', '.join(SCALES)}")
    for m in a.modes:
        if m not in MODES:
            p.error(f"--modes: {m}; allowed: {', '.join(MODES)}")
    if min(a.batches) < 1 or a.steps < 1 or a.warmup < 0 or a.prompt_bytes < 1 or a.rounds < 1:
        p.error("batches, --steps and --rounds >= 1, --warmup >= 0, --prompt-bytes >= 1")
    return a


class Weights:
    """Random bf16 weights of one scale: the dense part on the GPU, every expert in pinned host memory."""

    def __init__(self, s, seq_len, seed, dev):
        g = torch.Generator().manual_seed(seed)
        d, bf = s["d"], torch.bfloat16

        def rand(*shape, fan_in, where=dev):
            w = (torch.rand(*shape, generator=g) * 2 - 1) / math.sqrt(fan_in)
            return w.to(bf).to(where)

        self.embedding = ((torch.rand(VOCAB, d, generator=g) * 2 - 1).to(bf)).to(dev)
        self.position = ((torch.rand(seq_len, d, generator=g) * 2 - 1).to(bf)).to(dev)
        self.moe_blocks = [i for i in range(s["layers"]) if (i % 2 == 1 if s["every_other"] else True)]
        self.blocks = []
        for i in range(s["layers"]):
            b = dict(qkv=rand(d, 3 * d, fan_in=d), out=rand(d, d, fan_in=d))
            if i in self.moe_blocks:
                b["gate"] = rand(d, s["experts"], fan_in=d)
                # Generated on the GPU one expert at a time (the host's generator would take minutes
                # at the large scale), then kept in pinned host memory.
                b["w1"] = [self._pinned(d, s["hidden"], dev) for _ in range(s["experts"])]
                b["w2"] = [self._pinned(s["hidden"], d, dev) for _ in range(s["experts"])]
            else:
                b["w1"] = rand(d, s["dense_hidden"], fan_in=d)
                b["w2"] = rand(s["dense_hidden"], d, fan_in=s["dense_hidden"])
            self.blocks.append(b)

    @staticmethod
    def _pinned(rows, cols, dev):
        w = (torch.rand(rows, cols, device=dev) * 2 - 1) / math.sqrt(rows)
        return w.to(torch.bfloat16).cpu().pin_memory()


class ExpertCache:
    """C GPU slots of one expert each, shared by every MoE block, least recently used evicted. A
    slot being copied for a coming block (pregated) is pinned until that block has used it."""

    def __init__(self, slots, d, hidden, dev):
        self.w1 = [torch.empty(d, hidden, dtype=torch.bfloat16, device=dev) for _ in range(slots)]
        self.w2 = [torch.empty(hidden, d, dtype=torch.bfloat16, device=dev) for _ in range(slots)]
        self.where = collections.OrderedDict()  # (block, expert) -> slot, least recent first
        self.free = list(range(slots))
        self.pinned = set()
        self.copied_bytes = 0

    def slot(self, key, weights, stream):
        """The slot holding expert `key`, copied on `stream` if missing."""
        if key in self.where:
            self.where.move_to_end(key)
            return self.where[key]
        if self.free:
            s = self.free.pop()
        else:
            victim = next(k for k in self.where if k not in self.pinned)
            s = self.where.pop(victim)
        block, e = key
        with torch.cuda.stream(stream):
            self.w1[s].copy_(weights.blocks[block]["w1"][e], non_blocking=True)
            self.w2[s].copy_(weights.blocks[block]["w2"][e], non_blocking=True)
        self.copied_bytes += self.w1[s].numel() * 2 + self.w2[s].numel() * 2
        self.where[key] = s
        return s


class Decoder:
    def __init__(self, scale, weights, batch, seq_len, mode, slots, dev):
        self.s, self.w, self.n, self.mode, self.dev = scale, weights, batch, mode, dev
        d, heads = scale["d"], scale["heads"]
        self.k_cache = [torch.zeros(batch, heads, seq_len, d // heads, dtype=torch.bfloat16, device=dev)
                        for _ in range(scale["layers"])]
        self.v_cache = [torch.zeros_like(k) for k in self.k_cache]
        self.position = 0
        self.compute = torch.cuda.current_stream()
        self.copy = torch.cuda.Stream()
        if mode == "gpu_only":
            self.resident = {b: ([w.to(dev) for w in weights.blocks[b]["w1"]], [w.to(dev) for w in weights.blocks[b]["w2"]])
                             for b in weights.moe_blocks}
        elif mode in ("on_demand", "pregated"):
            self.cache = ExpertCache(slots, d, scale["hidden"], dev)
            self.ready = {}  # block -> the copy stream's event after its prefetched experts
            self.prefetched = {}  # block -> its experts chosen a block ahead
        else:  # prefetch_all: two buffers of E experts, the next MoE block's copied into the other
            E, H = scale["experts"], scale["hidden"]
            self.buffers = [([torch.empty(d, H, dtype=torch.bfloat16, device=dev) for _ in range(E)],
                             [torch.empty(H, d, dtype=torch.bfloat16, device=dev) for _ in range(E)]) for _ in range(2)]
            self.buffer_ready = [None, None]
            self.copied_bytes = 0

    # ---- the experts of one MoE block ----
    def route(self, block, h):
        probs = torch.softmax(h.float() @ self.w.blocks[block]["gate"].float(), dim=-1)
        top_p, top_e = probs.topk(self.s["top_k"], dim=-1)
        return top_p / top_p.sum(dim=-1, keepdim=True), top_e

    def experts_of(self, block, top_p, top_e, h):
        """(w1, w2) of each expert the rows chose, by expert id."""
        chosen = torch.unique(top_e).tolist()  # the host needs the ids: a synchronisation, as a user writes it
        if self.mode == "gpu_only":
            w1, w2 = self.resident[block]
            return {e: (w1[e], w2[e]) for e in chosen}
        if self.mode == "prefetch_all":
            j = self.w.moe_blocks.index(block)
            buffer = j % 2
            if self.buffer_ready[buffer] is None:  # m_0 of the step: nothing was copied ahead
                self._copy_all(block, buffer)
            self.compute.wait_event(self.buffer_ready[buffer])
            self.buffer_ready[buffer] = None
            nxt = self.w.moe_blocks[(j + 1) % len(self.w.moe_blocks)]
            if j + 1 < len(self.w.moe_blocks):
                self._copy_all(nxt, 1 - buffer)
            w1, w2 = self.buffers[buffer]
            return {e: (w1[e], w2[e]) for e in chosen}
        # on_demand and pregated: through the cache
        if block in self.ready:
            self.compute.wait_event(self.ready.pop(block))
        slots = {e: self.cache.slot((block, e), self.w, self.compute) for e in chosen}
        self.cache.pinned -= {(block, e) for e in chosen}
        return {e: (self.cache.w1[s], self.cache.w2[s]) for e, s in slots.items()}

    def _copy_all(self, block, buffer):
        self.copy.wait_stream(self.compute)  # the buffer's last reader is done
        w1, w2 = self.buffers[buffer]
        with torch.cuda.stream(self.copy):
            for e in range(self.s["experts"]):
                w1[e].copy_(self.w.blocks[block]["w1"][e], non_blocking=True)
                w2[e].copy_(self.w.blocks[block]["w2"][e], non_blocking=True)
        self.copied_bytes += 2 * self.s["experts"] * w1[0].numel() * 2
        self.buffer_ready[buffer] = self.copy.record_event()

    def prefetch_next(self, block, h):
        """pregated: the next MoE block's router on this block's LayerNorm output; its missing experts
        copied on the copy stream."""
        j = self.w.moe_blocks.index(block)
        if j + 1 >= len(self.w.moe_blocks):
            return
        nxt = self.w.moe_blocks[j + 1]
        top_p, top_e = self.route(nxt, h)
        self.prefetched[nxt] = (top_p, top_e)
        self.copy.wait_stream(self.compute)  # a victim's last reader is done
        for e in torch.unique(top_e).tolist():
            self.cache.slot((nxt, e), self.w, self.copy)
            self.cache.pinned.add((nxt, e))
        self.ready[nxt] = self.copy.record_event()

    def moe(self, block, h):
        if self.mode == "pregated" and block in self.prefetched:
            top_p, top_e = self.prefetched.pop(block)
        else:
            top_p, top_e = self.route(block, h)
        experts = self.experts_of(block, top_p, top_e, h)
        if self.mode == "pregated":
            # This block's experts stay put while the next block's are placed: the copies below may
            # run while this block computes.
            mine = {(block, e) for e in experts}
            self.cache.pinned |= mine
            self.prefetch_next(block, h)
            self.cache.pinned -= mine
        y = torch.zeros_like(h, dtype=torch.float32)
        for e, (w1, w2) in experts.items():
            rows, k = torch.where(top_e == e)
            out = F.gelu(h[rows] @ w1, approximate="tanh") @ w2
            y.index_add_(0, rows, out.float() * top_p[rows, k, None])
        return y.to(h.dtype)

    # ---- one position for every sequence ----
    def step(self, tokens):
        s, d, heads = self.s, self.s["d"], self.s["heads"]
        p = self.position
        x = (self.w.embedding[tokens].float() + self.w.position[p].float())
        for i, b in enumerate(self.w.blocks):
            h = F.layer_norm(x, (d,)).to(torch.bfloat16)
            q, k, v = (h @ b["qkv"]).view(self.n, 3, heads, d // heads).unbind(1)
            self.k_cache[i][:, :, p] = k
            self.v_cache[i][:, :, p] = v
            a = F.scaled_dot_product_attention(q.unsqueeze(2), self.k_cache[i][:, :, : p + 1],
                                               self.v_cache[i][:, :, : p + 1])
            x = x + (a.reshape(self.n, d) @ b["out"]).float()
            h = F.layer_norm(x, (d,)).to(torch.bfloat16)
            if i in self.w.moe_blocks:
                x = x + self.moe(i, h).float()
            else:
                x = x + (F.gelu(h @ b["w1"], approximate="tanh") @ b["w2"]).float()
        h = F.layer_norm(x, (d,)).to(torch.bfloat16)
        logits = h @ self.w.embedding.t()
        self.position += 1
        return logits.argmax(dim=-1)

    def bytes_copied(self):
        if self.mode in ("on_demand", "pregated"):
            return self.cache.copied_bytes
        return getattr(self, "copied_bytes", 0)


def run(a, name, weights, batch, mode, dev, round_):
    s = SCALES[name]
    seq_len = a.prompt_bytes + a.warmup + a.steps
    need_step = min(s["experts"], batch * s["top_k"]) if batch < s["experts"] else s["experts"]
    need_prompt = min(s["experts"], batch * a.prompt_bytes * s["top_k"]) if batch * a.prompt_bytes < s["experts"] else s["experts"]
    slots = min(max(math.ceil(a.cache_factor * need_step), need_prompt), len(weights.moe_blocks) * s["experts"])
    torch.manual_seed(a.seed)
    with torch.inference_mode():
        dec = Decoder(s, weights, batch, seq_len, mode, slots, dev)
        prompt = torch.randint(0, VOCAB, (batch, a.prompt_bytes), device=dev)
        warm_until = time.perf_counter() + 1.0
        while True:
            dec.position = 0  # the KV cache is written again from position 0
            for t in range(a.prompt_bytes):
                tokens = dec.step(prompt[:, t])
            torch.cuda.synchronize()
            if time.perf_counter() >= warm_until:
                break
        times, copied = [], None
        for i in range(a.warmup + a.steps):
            if i == a.warmup:
                copied = dec.bytes_copied()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            tokens = dec.step(tokens)
            end.record()
            end.synchronize()
            if i >= a.warmup:
                times.append(start.elapsed_time(end))
        mb_per_step = (dec.bytes_copied() - copied) / a.steps / 1e6
    del dec
    torch.cuda.empty_cache()
    return dict(scale=name, batch=batch, mode=mode, round=round_, cache_slots=slots if mode in ("on_demand", "pregated") else None,
                median_step_ms=statistics.median(times), min_step_ms=min(times), mb_per_step=mb_per_step,
                step_ms=times)


def main():
    a = parse()
    if not torch.cuda.is_available():
        print("torch_offload_baseline: no CUDA device", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    results = []
    for name in a.scales:
        weights = Weights(SCALES[name], a.prompt_bytes + a.warmup + a.steps, a.seed, dev)
        for batch in a.batches:
            for round_ in range(1, a.rounds + 1):
                for mode in a.modes:
                    r = run(a, name, weights, batch, mode, dev, round_)
                    results.append(r)
                    print(f"PyTorch {name} batch {batch} {mode} round {round_}: median step {r['median_step_ms']:.3f} ms "
                          f"(min {r['min_step_ms']:.3f}), {r['mb_per_step']:.0f} MB copied a step", flush=True)
        del weights
        torch.cuda.empty_cache()
    print(f"\n{'scale':8} {'batch':>5} " + " ".join(f"{m:>13}" for m in a.modes))
    for name in a.scales:
        for batch in a.batches:
            row = {}
            for r in results:
                if r["scale"] == name and r["batch"] == batch:
                    row[r["mode"]] = min(row.get(r["mode"], math.inf), r["median_step_ms"])
            print(f"{name:8} {batch:5} " + " ".join(f"{row[m]:13.2f}" for m in a.modes))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(what="torch_offload_baseline.py: offload_bench's decoding model and expert modes in PyTorch eager, ms a decode step",
                           device=torch.cuda.get_device_name(), torch=torch.__version__,
                           date=datetime.datetime.now(datetime.timezone.utc).isoformat(), args=vars(a), runs=results),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
