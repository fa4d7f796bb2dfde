"""Run by test_examples_hf_trainer.py under DeepSpeed's launcher: examples/hf_gpt2/train_trainer.py on the CPU.

accelerate (1.15.0, state.py ``PartialState._prepare_backend``) gives the Trainer's DeepSpeed a process group only
on an accelerator it knows, never gloo; so the state is configured here first, with gloo, and the Trainer takes it
(``--accelerator_config '{"use_configured_state": true}'``). The config ``run_job`` passes as DeepSpeed scripts
take it (``--deepspeed_config``) goes to the Trainer as ``--deepspeed``."""

import argparse
import json
import os
import runpy
import sys

from accelerate import PartialState

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "hf_gpt2", "train_trainer.py")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--valid-sequences")
    known, rest = parser.parse_known_args()
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    del os.environ["ACCELERATE_USE_DEEPSPEED"]
    sys.argv = [SCRIPT, "--deepspeed", known.deepspeed_config,
                "--accelerator_config", json.dumps({"use_configured_state": True}), *rest]
    sys.path.insert(0, os.path.dirname(SCRIPT))
    runpy.run_path(SCRIPT, run_name="__main__")


if __name__ == "__main__":
    main()
