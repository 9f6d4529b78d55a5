#!/usr/bin/env python3
"""kill_resume.py: moe_train killed with SIGKILL at random moments and resumed each time ends with
the losses of an uninterrupted run and every step recorded exactly once in events.jsonl.

  tests/train/kill_resume.py build/cuda/train/moe_train [--kills 7] [--seed N]

Run by CTest as train_kill_resume (it skips, exit 77, where there is no GPU). The runs use the tiny
preset on a generated text, long enough (1500 steps, a checkpoint every 25) for kills to land in
every part of a step: the forward, a flush of the event ring, a checkpoint being written.
"""
import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SKIP = 77  # CTest's SKIP_RETURN_CODE


def write_text(path, size=40000):
    subjects = ["the cat", "a dog", "my old friend", "the teacher", "every child", "our neighbour"]
    verbs = ["sees", "likes", "follows", "draws", "remembers", "finds"]
    objects = ["the red ball", "a small house", "the river", "an open door", "the garden", "a letter"]
    rng = random.Random(12345)
    parts, length = [], 0
    while length < size:
        s = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}{'.' if rng.random() < 0.25 else '. '}"
        parts.append(s)
        length += len(s)
    with open(path, "w") as f:
        f.write("".join(parts))


def step_losses(run_dir):
    """{step: loss} of the run's step events; a step recorded twice is returned in `twice`."""
    losses, twice = {}, []
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        for line in f:
            if not line.strip():
                continue
            event = json.loads(line)
            if event.get("type") == "step" and "loss" in event:
                if event["step"] in losses:
                    twice.append(event["step"])
                losses[event["step"]] = event["loss"]
    return losses, twice


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("moe_train")
    parser.add_argument("--kills", type=int, default=7)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    work = tempfile.mkdtemp(prefix="moe_kill_resume_")
    try:
        text = os.path.join(work, "text.txt")
        write_text(text)
        # moe_train checks its data and run directory before it looks for the GPU.
        probe = subprocess.run([args.moe_train, "--preset", "tiny", "--steps", "1", "--warmup-steps", "0",
                                "--data", text, "--run-dir", os.path.join(work, "probe")],
                               capture_output=True, text=True)
        if "no GPU" in probe.stderr:
            print(f"SKIPPED: {probe.stderr.strip()}")
            return SKIP
        common = ["--preset", "tiny", "--steps", "1500", "--checkpoint-every", "25", "--log-every", "5",
                  "--data", text]
        whole = os.path.join(work, "whole")
        subprocess.run([args.moe_train, *common, "--run-dir", whole], check=True, capture_output=True)
        want, _ = step_losses(whole)

        killed = os.path.join(work, "killed")
        start = time.monotonic()
        process = subprocess.Popen([args.moe_train, *common, "--run-dir", killed],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        kills = 0
        while True:
            time.sleep(rng.uniform(0.05, 0.6))
            if process.poll() is not None:  # finished before the next kill
                if process.returncode != 0:
                    print(f"FAIL: moe_train exited {process.returncode}: {process.stderr.read().decode()}")
                    return 1
                break
            process.send_signal(signal.SIGKILL)
            process.wait()
            kills += 1
            checkpoints = os.path.join(killed, "checkpoints")
            has_checkpoint = os.path.isdir(checkpoints) and any(
                name.startswith("checkpoint_") and name.endswith(".ckpt") for name in os.listdir(checkpoints))
            resume = ["--resume"] if has_checkpoint else ["--overwrite"]
            if kills >= args.kills:  # the last resume runs to the end
                result = subprocess.run([args.moe_train, *common, "--run-dir", killed, *resume],
                                        capture_output=True, text=True)
                if result.returncode != 0:
                    print(f"FAIL: the last resume exited {result.returncode}: {result.stderr}")
                    return 1
                break
            process = subprocess.Popen([args.moe_train, *common, "--run-dir", killed, *resume],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        got, twice = step_losses(killed)
        print(f"seed {seed}: {kills} kills in {time.monotonic() - start:.1f} s; "
              f"{len(got)} steps recorded, {len(twice)} recorded twice")
        failures = []
        if twice:
            failures.append(f"steps recorded twice: {sorted(set(twice))[:20]}")
        missing = sorted(set(want) - set(got))
        if missing:
            failures.append(f"steps missing: {missing[:20]}")
        differ = [s for s in want if s in got and got[s] != want[s]]
        if differ:
            s = differ[0]
            failures.append(f"{len(differ)} losses differ from the uninterrupted run's, first at step {s}: "
                            f"{got[s]} against {want[s]}")
        for failure in failures:
            print(f"FAIL: {failure}")
        if not failures:
            print("PASS: every step once, every loss equal to the uninterrupted run's")
        return 1 if failures else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
