"""Run under DeepSpeed's launcher by test_coordinator.py: examples/gpt/train_gpt.py with a small vitp (so that a piece of
its training fits a bubble) and a forward pass that takes at least FORWARD_S seconds (so that the bubbles are long
on a loaded CPU, without using it)."""

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))

import train_gpt  # noqa: E402
from deepspeed.runtime.pipe.module import PipelineModule  # noqa: E402

from cpsr_ds.runtime import runtime  # noqa: E402
from cpsr_ds.predictor import VITPPredictor  # noqa: E402

FORWARD_S = 0.06


def small_vitp(cfg, shards=1):
    p = cfg.predictor
    return VITPPredictor(token_size=256, batch_chunks=16, d_model=16, heads=2, layers=1, history=p.history,
                         params=p.params, moments=p.moments, shards=shards)


def slow(forward):
    def forward_pass(self, *args, **kwargs):
        time.sleep(FORWARD_S)
        return forward(self, *args, **kwargs)
    return forward_pass


if __name__ == "__main__":
    runtime.new_predictor = small_vitp
    PipelineModule.forward = slow(PipelineModule.forward)
    train_gpt.main()
