"""benchmarks/checkpoint_slowdown.py: its variants' blocks and its per-round ratios (the runs are the benchmark's)."""

import pytest

from conftest import load_benchmark
from cpsr_ds.config import CPSRConfig

slowdown = load_benchmark("checkpoint_slowdown")


@pytest.mark.parametrize("variant", sorted(slowdown.VARIANTS))
def test_every_variant_is_a_valid_block_at_the_fixed_interval(variant):
    block = slowdown.cpsr_block(variant, 18, 3.7)
    cfg = CPSRConfig.model_validate({**block, "checkpoint": {**block["checkpoint"], "dir": "/tmp/x"}})
    assert cfg.checkpoint.interval == 18 and cfg.checkpoint.write_mbps == 3.7
    assert cfg.checkpoint.strategy == slowdown.VARIANTS[variant][0]


def test_the_variants_differ_in_the_predictors_work_only():
    blocks = {v: slowdown.cpsr_block(v, 18, 3.7) for v in ("cpsr_recompute", "cpsr_skip", "cpsr")}
    assert blocks["cpsr_recompute"]["recovery"]["mode"] == "recompute"
    assert blocks["cpsr_skip"]["predictor"]["name"] == "skip" and blocks["cpsr_skip"]["recovery"]["mode"] == "auto"
    assert "predictor" not in blocks["cpsr"] and blocks["cpsr"]["recovery"]["mode"] == "auto"


def test_each_rounds_slowdown_is_set_against_checkfreqs_of_the_same_round():
    runs = {"checkfreq": [{"slowdown_ms": 10.0, "on_loop_ms": 4, "iteration_ms": 25},
                          {"slowdown_ms": 40.0, "on_loop_ms": 4, "iteration_ms": 25}],
            "cpsr": [{"slowdown_ms": 30.0, "on_loop_ms": 9, "iteration_ms": 25},
                     {"slowdown_ms": 40.0, "on_loop_ms": 9, "iteration_ms": 25}]}
    args = slowdown.parse_args(["--rounds", "2", "--variants", "checkfreq", "cpsr"])
    result = slowdown.summarize_runs(runs, args, 3.7)
    assert result["slowdown_over_checkfreq"]["cpsr"]["median"] == pytest.approx(2.0)  # 3 and 1
    assert result["slowdown_ms"]["cpsr"]["median"] == pytest.approx(35.0)
