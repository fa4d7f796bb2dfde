"""Each example with cpsr_ds differs from the same script without it in at most 3 lines, the ones its how-to page
quotes."""

import os

import pytest

from conftest import ROOT
from support.examples import changed_lines, example_path

PAIRS = [("hf_gpt2", "train_deepspeed.py", "train.py", "hf-gpt2.md"),
         ("hf_gpt2", "train_trainer_deepspeed.py", "train_trainer.py", "hf-trainer.md"),
         ("megatron_gpt", "train_deepspeed.py", "train.py", "megatron-gpt.md")]


@pytest.mark.parametrize("example,without,with_cpsr,page", PAIRS)
def test_a_user_changes_at_most_3_lines_and_the_docs_quote_them(example, without, with_cpsr, page):
    changed = changed_lines(example_path(example, without), example_path(example, with_cpsr))
    assert 0 < len(changed) <= 3, changed
    with open(os.path.join(ROOT, "docs", "how-to", page)) as f:
        quoted = f.read().splitlines()
    assert all(f"+{line}" in quoted for line in changed), changed
