#!/usr/bin/env python3
"""stop_resume.py: moe_train stopped by SIGINT or SIGTERM ends cleanly: it finishes the step in
flight, writes that step's checkpoint, flushes every step's event up to it, names the command that
resumes it and exits 130 (SIGINT) or 143 (SIGTERM); that command ends the run with the losses of an
uninterrupted run and every step recorded once.

  tests/train/stop_resume.py build/cuda/train/moe_train

Run by CTest as train_stop_resume (it skips, exit 77, where there is no GPU). The runs use the tiny
preset on a generated text; checkpoints are rare (every 200 steps), so a stop lands between them and
its checkpoint is the one the signal asked for.
"""
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import shutil
import time

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kill_resume import SKIP, step_losses, write_text  # noqa: E402


def last_recorded_step(run_dir):
    try:
        losses, _ = step_losses(run_dir)
    except (FileNotFoundError, ValueError):  # not written yet, or a line half-written right now
        return 0
    return max(losses, default=0)


def stop_and_resume(moe_train, common, run_dir, which, want):
    """Returns a list of failures."""
    process = subprocess.Popen([moe_train, *common, "--run-dir", run_dir],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while last_recorded_step(run_dir) < 20 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if process.poll() is not None:
        return [f"{which.name}: moe_train ended (exit {process.returncode}) before it could be stopped: "
                f"{process.stderr.read()}"]
    process.send_signal(which)
    try:
        _, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        return [f"{which.name}: moe_train did not stop within 120 s"]
    failures = []
    expected = 128 + which.value
    if process.returncode != expected:
        failures.append(f"{which.name}: exit {process.returncode}, expected {expected}; stderr: {stderr}")
    marker = "continue with: "
    if marker not in stderr or f"stopped by {which.name} after step " not in stderr:
        return failures + [f"{which.name}: stderr does not say where to resume: {stderr}"]
    stopped_at = int(stderr.split("after step ")[1].split(";")[0])
    checkpoint = os.path.join(run_dir, "checkpoints", f"checkpoint_{stopped_at:08d}.ckpt")
    if not os.path.isfile(checkpoint):
        failures.append(f"{which.name}: no checkpoint of step {stopped_at} ({checkpoint})")
    if last_recorded_step(run_dir) != stopped_at:
        failures.append(f"{which.name}: the record ends at step {last_recorded_step(run_dir)}, "
                        f"the run stopped after step {stopped_at}")
    command = shlex.split(stderr.split(marker)[1].strip().splitlines()[0])
    if command[0] != "moe_train" or "--resume" not in command:
        return failures + [f"{which.name}: the resume command is not moe_train ... --resume: {command}"]
    resumed = subprocess.run([moe_train, *command[1:]], capture_output=True, text=True)
    if resumed.returncode != 0:
        return failures + [f"{which.name}: the resume exited {resumed.returncode}: {resumed.stderr}"]
    got, twice = step_losses(run_dir)
    print(f"{which.name}: stopped after step {stopped_at} (exit {process.returncode}), resumed to step {max(got)}")
    if twice:
        failures.append(f"{which.name}: steps recorded twice: {sorted(set(twice))[:20]}")
    if sorted(got) != sorted(want):
        failures.append(f"{which.name}: {len(got)} steps recorded, the uninterrupted run has {len(want)}")
    differ = [s for s in want if s in got and got[s] != want[s]]
    if differ:
        failures.append(f"{which.name}: {len(differ)} losses differ from the uninterrupted run's, first at step "
                        f"{differ[0]}")
    return failures


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    moe_train = sys.argv[1]
    work = tempfile.mkdtemp(prefix="moe_stop_resume_")
    try:
        text = os.path.join(work, "text.txt")
        write_text(text)
        common = ["--preset", "tiny", "--steps", "600", "--checkpoint-every", "200", "--log-every", "5",
                  "--data", text]
        whole = os.path.join(work, "whole")
        first = subprocess.run([moe_train, *common, "--run-dir", whole], capture_output=True, text=True)
        if "no GPU" in first.stderr:
            print(f"SKIPPED: {first.stderr.strip()}")
            return SKIP
        if first.returncode != 0:
            print(f"FAIL: the uninterrupted run exited {first.returncode}: {first.stderr}")
            return 1
        want, _ = step_losses(whole)
        failures = []
        for which in (signal.SIGINT, signal.SIGTERM):
            failures += stop_and_resume(moe_train, common, os.path.join(work, which.name), which, want)
        for failure in failures:
            print(f"FAIL: {failure}")
        if not failures:
            print("PASS: SIGINT and SIGTERM stop with a checkpoint, exit 130 / 143, and the resume "
                  "ends with the uninterrupted run's losses, every step once")
        return 1 if failures else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
