import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from cpsr_ds import ConfigError, CPSRConfig
from cpsr_ds.config import FaultConfig


@pytest.mark.parametrize(
    "block, message",
    [
        ({"bogus": 1}, r"cpsr\.bogus: unknown key \(allowed: enabled, checkpoint, faults, predictor, recovery, planner, coordinator\)"),
        ({"predictor": {"name": "lstm"}}, r"cpsr\.predictor\.name: Input should be 'skip', 'linear', 'trend', 'damped', 'ridge' or 'vitp'"),
        ({"recovery": {"mode": "guess"}}, r"cpsr\.recovery\.mode: Input should be 'auto', 'predict' or 'recompute'"),
        ({"recovery": {"max_relative_error": 0}}, r"cpsr\.recovery\.max_relative_error: Input should be greater than 0"),
        ({"checkpoint": {"keep_last": 3}, "predictor": {"history": 5}},
         r"cpsr: checkpoint\.keep_last \(3\) must be at least predictor\.history \(5\)"),
        ({"checkpoint": {"keep_last": 8}, "predictor": {"name": "vitp", "history": 4}},
         r"cpsr: predictor\.history \(4\) must be at least 6 for vitp"),
        ({"recovery": {"guard_reduction": 0.5}}, r"cpsr\.recovery\.guard_reduction: unknown key"),
        ({"planner": {"cost_model": "oracle"}},
         r"cpsr\.planner\.cost_model: Input should be 'empirical', 'paper' or 'paper-eq14'"),
        ({"planner": {"failure_rate_per_hour": 0}}, r"cpsr\.planner\.failure_rate_per_hour: Input should be greater than 0"),
        ({"faults": {"kill_at_iteration": [30, 0]}},
         r"cpsr\.faults\.kill_at_iteration: expected an iteration > 0, a list of them or null \(got \[30, 0\]\)"),
        ({"predictor": {"train_budget_s": None}},
         r"cpsr\.predictor: train_budget_s and train_steps are both null"),
        ({"predictor": {"device": "gpu"}}, r"cpsr\.predictor\.device: Input should be 'cpu' or 'cuda'"),
        ({"predictor": {"device": "cuda"}},
         r"cpsr\.predictor: device 'cuda' is for the learning predictor vitp; trend works on the host copies"),
        ({"checkpoint": {"intervall": 5}}, r"cpsr\.checkpoint\.intervall: unknown key \(allowed: dir, interval"),
        ({"checkpoint": {"interval": 0}}, r'cpsr\.checkpoint\.interval: expected a whole number of iterations > 0 or "auto" \(got 0\)'),
        ({"checkpoint": {"interval": "50"}}, r'cpsr\.checkpoint\.interval: expected a whole number of iterations > 0 or "auto" \(got \'50\'\)'),
        ({"checkpoint": {"strategy": "fast"}}, r"cpsr\.checkpoint\.strategy: Input should be 'torch', 'checkfreq', 'pccheck' or 'cpsr'"),
        ({"faults": {"kill_rank": -1}}, r"cpsr\.faults\.kill_rank: Input should be greater than or equal to 0"),
        ({"faults": {"poisson_rate_per_hour": -0.5}}, r"cpsr\.faults\.poisson_rate_per_hour: Input should be greater than or equal to 0"),
        ({"enabled": "yes"}, r"cpsr\.enabled: Input should be a valid boolean"),
        ({"faults": []}, r"cpsr\.faults: Input should be an object|cpsr\.faults: Input should be a valid dictionary"),
        ([], r"cpsr: expected an object, got list"),
        ({"checkpoint": {"retry_backoff_s": float("inf")}}, r"cpsr\.checkpoint\.retry_backoff_s: Input should be a finite number"),
        ({"checkpoint": {"retry_backoff_s": 1e9}}, r"cpsr\.checkpoint\.retry_backoff_s: Input should be less than or equal to 3600"),
        ({"checkpoint": {"commit_timeout_s": float("inf")}}, r"cpsr\.checkpoint\.commit_timeout_s: Input should be a finite number"),
        ({"checkpoint": {"commit_timeout_s": float("nan")}}, r"cpsr\.checkpoint\.commit_timeout_s: Input should be a finite number"),
        ({"checkpoint": {"commit_timeout_s": 1e12}}, r"cpsr\.checkpoint\.commit_timeout_s: Input should be less than or equal to 86400"),
        ({"recovery": {"max_loss_excess": float("nan")}}, r"cpsr\.recovery\.max_loss_excess: Input should be a finite number"),
        ({"checkpoint": {"dir": "runs/a\0b"}}, r"cpsr\.checkpoint\.dir: a path cannot contain a NUL byte"),
        ({"checkpoint": {"dir": "runs/" + "x" * 256}}, r"cpsr\.checkpoint\.dir: path component 'x+'\.\.\. is longer than 255 bytes"),
    ],
)
def test_bad_input_names_the_key(block, message):
    with pytest.raises(ValueError, match=message):
        CPSRConfig.from_ds_config({"train_batch_size": 8, "cpsr": block})


def test_every_error_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        CPSRConfig.from_ds_config({"cpsr": {"checkpoint": {"interval": -3}, "faults": {"seed": "x"}}})
    assert "cpsr.checkpoint.interval" in str(err.value) and "cpsr.faults.seed" in str(err.value)


def test_no_block_means_disabled_and_defaults_apply():
    assert CPSRConfig.from_ds_config({"train_batch_size": 8}).enabled is False
    cfg = CPSRConfig.from_ds_config({"cpsr": {"checkpoint": {"interval": 7}}})
    assert cfg.enabled and cfg.checkpoint.interval == 7 and cfg.checkpoint.dir == "checkpoints"
    assert cfg.faults == FaultConfig()


def test_launcher_rejects_a_bad_block_before_training(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 1, "cpsr": {"checkpoint": {"interval": 0}}}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "gpt", "train_gpt.py"), "--deepspeed_config", str(path)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )  # fmt: skip
    assert result.returncode != 0
    assert 'cpsr.checkpoint.interval: expected a whole number of iterations > 0 or "auto" (got 0)' in result.stderr
    assert "iteration" not in result.stdout


@pytest.mark.parametrize("option", ["--log-interval", "--eval-interval"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_launcher_rejects_an_interval_that_is_not_positive_at_parse_time(option, value, capsys):
    sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
    import train_gpt

    with pytest.raises(SystemExit):
        train_gpt.parse_args([option, value])
    assert f"argument {option}: must be a positive integer, got '{value}'" in capsys.readouterr().err


@pytest.mark.parametrize("value, message", [
    (0, r"cpsr\.predictor\.memory_mb: Input should be greater than 0"),
    ("big", r"cpsr\.predictor\.memory_mb: Input should be a valid number"),
])
def test_a_bad_predictor_memory_cap_is_named(value, message):
    with pytest.raises(ConfigError, match=message):
        CPSRConfig.parse_block({"predictor": {"memory_mb": value}})
    assert CPSRConfig.parse_block({}).predictor.memory_mb == 200.0
