"""Run under DeepSpeed's launcher by test_exit.py and test_background.py: examples/gpt/train_gpt.py's job, ended as
PROBE_END says, then one JSON line per rank with what the rank leaves to the interpreter's teardown.

PROBE_END=main: train_gpt.main, whose clean end destroys the engine and the process group;
PROBE_END=train: setup and train only, as a script that leaves everything to the interpreter's exit."""

import json
import os
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))

import torch.distributed as dist  # noqa: E402

import train_gpt  # noqa: E402

if __name__ == "__main__":
    if os.environ["PROBE_END"] == "main":
        train_gpt.main()
    else:
        train_gpt.train(train_gpt.setup())
    row = {"rank": int(os.environ["RANK"]), "process_group": dist.is_initialized(),
           "threads": sorted(t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive())}
    # One write: the ranks share the launcher's stdout, and print's text and newline go out apart.
    os.write(sys.stdout.fileno(), f"probe {json.dumps(row)}\n".encode())
