import glob
import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, ROOT)

# Small enough that a 2-process run takes seconds, big enough to learn something.
TEST_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(run_dir, stages=2, zero_stage=0, **cpsr) -> dict:
    with open(os.path.join(ROOT, "configs", "gpt_tiny_cpu.json")) as f:
        config = json.load(f)
    config.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    config["pipeline"] = {"stages": stages}
    config["zero_optimization"] = {"stage": zero_stage}
    config["gpt"] = dict(TEST_MODEL)
    config["cpsr"] = {"checkpoint": {"dir": str(run_dir), "interval": 10}, **cpsr}
    return config


def run_job(tmp_path, config: dict, *args, supervised: bool = False, nprocs: int = 2, timeout: int = 300,
            script: str = os.path.join(ROOT, "launch", "train_gpt.py"), env: dict | None = None, check: bool = True):
    """Launch ``script`` (default launch/train_gpt.py) under DeepSpeed's launcher (and the supervisor).

    With ``check`` a failed job fails the test; the result is returned either way.
    """
    config_path = tmp_path / f"ds_config_{free_port()}.json"
    config_path.write_text(json.dumps(config))
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    port = free_port()
    command = [deepspeed, "--num_gpus", str(nprocs), "--master_port", str(port),
               script, "--deepspeed_config", str(config_path),
               "--valid-sequences", "16", *map(str, args)]  # fmt: skip
    if supervised:
        command = [os.path.join(ROOT, "launch", "resilient.sh"), "--max-restarts", "2", "--", *command]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", **(env or {}))
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"job failed with exit code {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    # Every rank, killed ones included, released DeepSpeed's shared-memory buffer at start.
    assert result.returncode != 0 or not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"), "a job left its /dev/shm buffers behind"
    return result
