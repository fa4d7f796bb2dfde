"""benchmarks/checkpoint_slowdown.py: its variants' blocks and its per-round ratios (the runs are the benchmark's)."""

import importlib

import pytest

from cpsr_ds.config import CPSRConfig

slowdown = importlib.import_module("benchmarks.checkpoint_slowdown")


@pytest.mark.parametrize("variant", sorted(slowdown.VARIANTS))
def test_every_variant_is_a_valid_block_at_the_fixed_interval(variant):
    block = slowdown.cpsr_block(variant, 18, 3.7)
    cfg = CPSRConfig.model_validate({**block, "checkpoint": {**block["checkpoint"], "dir": "/tmp/x"}})
    never = slowdown.bench_ftcost.NEVER
    assert cfg.checkpoint.interval == (never if variant == slowdown.NONE else 18) and cfg.checkpoint.write_mbps == 3.7
    assert cfg.checkpoint.strategy == slowdown.VARIANTS[variant][0]


def test_the_variants_differ_in_the_predictors_work_only():
    blocks = {v: slowdown.cpsr_block(v, 18, 3.7) for v in ("cpsr_recompute", "cpsr_skip", "cpsr")}
    assert blocks["cpsr_recompute"]["recovery"]["mode"] == "recompute"
    assert blocks["cpsr_skip"]["predictor"]["name"] == "skip" and blocks["cpsr_skip"]["recovery"]["mode"] == "auto"
    assert "predictor" not in blocks["cpsr"] and blocks["cpsr"]["recovery"]["mode"] == "auto"


def test_each_rounds_slowdown_is_set_against_checkfreqs_of_the_same_round():
    runs = {"checkfreq": [{"slowdown_ms": 10.0, "on_loop_ms": 4, "iteration_ms": 25, "mean_iteration_ms": 27},
                          {"slowdown_ms": 40.0, "on_loop_ms": 4, "iteration_ms": 25, "mean_iteration_ms": 27}],
            "cpsr": [{"slowdown_ms": 30.0, "on_loop_ms": 9, "iteration_ms": 25, "mean_iteration_ms": 27},
                     {"slowdown_ms": 40.0, "on_loop_ms": 9, "iteration_ms": 25, "mean_iteration_ms": 27}]}
    args = slowdown.parse_args(["--rounds", "2", "--variants", "checkfreq", "cpsr"])
    result = slowdown.summarize_runs(runs, args, 3.7)
    assert result["slowdown_over_checkfreq"]["cpsr"]["median"] == pytest.approx(2.0)  # 3 and 1
    assert result["slowdown_ms"]["cpsr"]["median"] == pytest.approx(35.0)


def test_each_variants_mean_iteration_is_set_against_the_checkpoint_free_run_of_the_same_round():
    def run(checkpoints, mean_ms):
        return {"checkpoints": checkpoints, "slowdown_ms": None if not checkpoints else 5.0, "on_loop_ms": None,
                "iteration_ms": 25.0, "mean_iteration_ms": mean_ms}

    # Round 1 ran on a host 10 ms slower an iteration: the pairing takes that out.
    runs = {"none": [run(0, 25.0), run(0, 35.0)], "pccheck": [run(100, 28.0), run(100, 38.0)],
            "cpsr": [run(25, 26.0), run(25, 36.0)]}
    args = slowdown.parse_args(["--rounds", "2", "--iters", "1000", "--variants", "none", "pccheck", "cpsr",
                                "--interval", "40", "--interval-of", "pccheck=10"])
    result = slowdown.summarize_runs(runs, args, 3.7)
    assert result["intervals"] == {"pccheck": 10, "cpsr": 40}
    assert result["excess_over_none_ms"]["pccheck"]["median"] == pytest.approx(3.0)
    assert result["excess_over_none_ms"]["cpsr"]["median"] == pytest.approx(1.0)
    assert result["excess_per_checkpoint_ms"]["pccheck"]["median"] == pytest.approx(30.0)  # 3 ms x 1000 / 100
    assert result["excess_per_checkpoint_ms"]["cpsr"]["median"] == pytest.approx(40.0)
    assert "none" not in result["excess_over_none_ms"] and result["slowdown_ms"]["none"]["median"] is None


@pytest.mark.parametrize("spec", ["pccheck", "pccheck=0", "pccheck=x", "checkfreq=10", "none=5"])
def test_a_bad_interval_of_is_refused(spec, capsys):
    with pytest.raises(SystemExit):
        slowdown.parse_args(["--variants", "none", "pccheck", "--interval-of", spec])
    assert "--interval-of" in capsys.readouterr().err
