"""Run under DeepSpeed's launcher by test_coordinator.py: examples/gpt/train_gpt.py with a small vitp (so that a piece of
its training fits a bubble) and a forward pass that takes at least FORWARD_S seconds (so that the bubbles are long
on a loaded CPU, without using it)."""

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))

import train_gpt  # noqa: E402
from deepspeed.runtime.pipe import schedule  # noqa: E402

from cpsr_ds import plugin  # noqa: E402
from cpsr_ds.predictor import VITPPredictor  # noqa: E402

FORWARD_S = 0.06


def small_vitp(cfg, shards=1):
    p = cfg.predictor
    return VITPPredictor(token_size=256, batch_chunks=16, d_model=16, heads=2, layers=1, history=p.history,
                         params=p.params, moments=p.moments, shards=shards)


def slow(forward):
    def forward_pass(self, buffer_id):
        time.sleep(FORWARD_S)
        forward(self, buffer_id)
    return forward_pass


if __name__ == "__main__":
    plugin.new_predictor = small_vitp
    table = plugin.CPSRPipelineEngine._INSTRUCTION_MAP
    table[schedule.ForwardPass] = slow(table[schedule.ForwardPass])
    train_gpt.main()
