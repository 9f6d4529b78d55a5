"""power_trace.py: the SM clock and board power while moe_bench times each formulation.

Run (on the GPU machine):
    python3 cuda/bench/power_trace.py --out power.json -- build-bench/cuda/bench/moe_bench --shapes baselines

Why: a GPU at its power limit sets its own clock, and the clock follows the energy each operation
costs: bytes moved through HBM and the L2 cost energy that multiply-adds do not. Two formulations
timed side by side may then run at different clocks, and a kernel that is faster at locked clocks
(ncu --clock-control base) can lose at the card's own (lesson 03, "The power limit sets the clock").

How: nvidia-smi samples clocks.sm, power.draw and clocks_event_reasons.active every --interval-ms
while the command runs; moe_bench announces each timing phase as it starts ("timing NAME forward",
"timing NAME forward+backward"; its "time" line ends the second), and every line of both is
stamped on arrival with one clock. A phase's figures are the medians over the last
(1 - --skip) of its span: the span starts with moe_bench's warm-up of at least a second of the same
work (clock_warm_up.h), whose first part is the clock ramping up. The command's output passes
through unchanged; the table comes after it, and the exit code is the command's.
"""
import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time

QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"
# clocks_event_reasons.active bits that hold the clock down (nvidia-smi --help-query-gpu)
REASONS = {0x1: "idle", 0x4: "sw power cap", 0x8: "hw slowdown", 0x20: "sw thermal", 0x40: "hw thermal",
           0x80: "hw power brake"}


def start_sampler(gpu, interval_ms, samples):
    """nvidia-smi in loop mode on one GPU; each CSV line becomes (arrival time, MHz, W, reason bits)."""
    process = subprocess.Popen(["nvidia-smi", f"--id={gpu}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                f"-lms={interval_ms}"], stdout=subprocess.PIPE, text=True, bufsize=1)

    def read():
        for line in process.stdout:
            fields = [f.strip() for f in line.split(",")]
            try:
                samples.append((time.monotonic(), float(fields[0]), float(fields[1]), int(fields[2], 16)))
            except (IndexError, ValueError):
                continue  # "[N/A]": no sample
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return process, thread


def phases_of(lines):
    """(start, end, label, formulation, phase) from moe_bench's stamped lines."""
    phases, open_phase, label = [], None, ""
    for stamp, line in lines:
        shape = re.match(r"(T=\d+ D=\d+ H=\d+ E=\d+ K=\d+ \w+): max", line)
        if shape:
            label = shape.group(1)
        timing = re.match(r"\s+timing (\S+) (forward|forward\+backward)$", line)
        if timing or re.match(r"\s+time ", line) or line.startswith("=="):
            if open_phase:
                phases.append((open_phase[0], stamp) + open_phase[1:])
                open_phase = None
        if timing:
            open_phase = (stamp, label, timing.group(1), timing.group(2))
    return phases


def summarise(phases, samples, skip):
    rows = []
    for start, end, label, formulation, phase in phases:
        begin = start + skip * (end - start)
        window = [s for s in samples if begin <= s[0] <= end]
        if not window:
            continue  # shorter than one sampling interval
        rows.append({"shape": label, "formulation": formulation, "phase": phase, "samples": len(window),
                     "seconds": round(end - begin, 3),
                     "sm_clock_mhz": statistics.median(s[1] for s in window),
                     "sm_clock_min_mhz": min(s[1] for s in window),
                     "power_w": statistics.median(s[2] for s in window),
                     # each reason with the share of the samples in which it held the clock
                     "clock_held_by": {name: round(sum(1 for s in window if s[3] & bit) / len(window), 2)
                                       for bit, name in REASONS.items() if any(s[3] & bit for s in window)}})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", default="0", help="nvidia-smi's index (or UUID) of the GPU the command runs on")
    parser.add_argument("--interval-ms", type=int, default=20, help="nvidia-smi's sampling interval")
    parser.add_argument("--skip", type=float, default=0.4, help="share of each phase left out at its start")
    parser.add_argument("--out", help="also write the table as JSON")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- and the command (moe_bench ...)")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: give it after --, e.g. -- build-bench/cuda/bench/moe_bench --shapes small")
    if not 0 <= args.skip < 1 or args.interval_ms < 1:
        parser.error("--skip must be in [0, 1) and --interval-ms at least 1")
    if shutil.which("nvidia-smi") is None:
        sys.exit("power_trace.py: nvidia-smi not found: it reads the clock and power (NVIDIA driver tools)")
    if shutil.which(command[0]) is None:
        sys.exit(f"power_trace.py: {command[0]}: no such program")

    samples, lines = [], []
    sampler, reader = start_sampler(args.gpu, args.interval_ms, samples)
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    for line in run.stdout:
        lines.append((time.monotonic(), line.rstrip("\n")))
        print(line, end="", flush=True)
    code = run.wait()
    sampler.terminate()
    sampler.wait()
    reader.join(timeout=2)

    rows = summarise(phases_of(lines), samples, args.skip)
    if not samples:
        print("power_trace.py: nvidia-smi gave no samples", file=sys.stderr)
    print(f"\nSM clock and board power, medians over each phase's last {100 * (1 - args.skip):.0f}% "
          f"({len(samples)} samples, every {args.interval_ms} ms):")
    print(f"{'shape':40s} {'formulation':18s} {'phase':16s} {'MHz':>6s} {'min':>6s} {'W':>6s}  clock held by (% of samples)")
    for r in rows:
        print(f"{r['shape']:40s} {r['formulation']:18s} {r['phase']:16s} {r['sm_clock_mhz']:6.0f} "
              f"{r['sm_clock_min_mhz']:6.0f} {r['power_w']:6.0f}  "
              f"{', '.join(f'{n} {100 * v:.0f}%' for n, v in r['clock_held_by'].items()) or '-'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": command, "interval_ms": args.interval_ms, "skip": args.skip, "phases": rows}, f,
                      indent=1)
        print(f"wrote {args.out}")
    sys.exit(code)


if __name__ == "__main__":
    main()
