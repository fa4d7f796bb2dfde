"""Predicting-based recovery at GPT2-0.35B's shape on one GPU: bench_recovery's protocol, cut to fit a 64 GB disk.

    python -m benchmarks.gpu.recovery --json PATH --no-cost-model [bench_recovery's options]

A reference of K = 20 intervals writes 20 checkpoints; at GPT2-0.35B's size (bf16, fp32 masters and Adam, ZeRO-1)
each holds 4.2 GB, 84 GB in all. So the reference deletes each committed checkpoint that no recovery reads (every
failure's checkpoint c and the predictor's history before it) after each interval it trains, and keeps at most
3 x 4 of them (50 GB). The recovery cost models' check reads the 8 checkpoints before each failure (and holds each
in host memory, 3.6 GB): it is left out (``--no-cost-model``). Every failure's cases are appended to PATH's
``.cases.jsonl`` as soon as they are measured, so that a run cut short keeps them; PATH holds bench_recovery's
summary at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

from benchmarks import bench_recovery
from cpsr_ds.checkpoint.storage.catalog import list_checkpoints  # noqa: E402
from cpsr_ds.config import PredictorConfig  # noqa: E402


def recovered_from(failures: list[tuple[int, int]], Tc: int, history: int) -> set[int]:
    """The checkpoints the recoveries of ``failures`` ((c, d) pairs) read: each c and the ``history - 1`` before it."""
    return {c - j * Tc for c, _ in failures for j in range(history)}


class PrunedSeed(bench_recovery.Seed):
    """A seed whose reference keeps on storage only the checkpoints a recovery reads."""

    keep: set[int] | None = None  # while the reference trains: the iterations of the checkpoints kept

    def run_reference(self, failures) -> None:
        self.keep = recovered_from(failures, self.Tc, PredictorConfig().history)
        try:
            super().run_reference(failures)
            self.prune()
        finally:
            self.keep = None
        kept = sorted(ck.iteration for ck in list_checkpoints(self.ref_dir, read_data=False) if ck.valid)
        print(f"seed {self.seed} T_c {self.Tc}: the reference kept the checkpoints at {kept}", flush=True)

    def train(self, start: int, stop: int, evaluate_at=()) -> dict[int, float]:
        """Seed.train an interval at a time, pruning after each while the reference trains."""
        if self.keep is None:
            return super().train(start, stop, evaluate_at)
        losses: dict[int, float] = {}
        for first in range(start, stop, self.Tc):
            losses |= super().train(first, min(first + self.Tc, stop), set(evaluate_at) - set(losses))
            self.prune()
        return losses

    def prune(self) -> None:
        """Delete the committed checkpoints not kept (the one being written is not committed yet)."""
        for ck in list_checkpoints(self.ref_dir, read_data=False):
            if ck.valid and ck.iteration not in self.keep:
                shutil.rmtree(os.path.join(self.ref_dir, ck.tag))


def record_cases(path: str):
    """An ``on_cases`` for bench_recovery.run that appends each case to ``path`` as one JSON line."""
    open(path, "w").close()

    def on_cases(cases) -> None:
        with open(path, "a") as f:
            for case in cases:
                f.write(json.dumps(dataclasses.asdict(case)) + "\n")

    return on_cases


def main(argv=None) -> None:
    args = bench_recovery.parse_args(argv)
    if not args.json or args.cost_model or args.merge or args.layouts:
        raise SystemExit("recovery.py: give --json PATH and --no-cost-model (the checkpoints it reads are deleted), "
                         "and neither --merge nor --layouts (bench_recovery's own)")
    bench_recovery.main(argv, seed_class=PrunedSeed,
                        on_cases=record_cases(os.path.splitext(args.json)[0] + ".cases.jsonl"))


if __name__ == "__main__":
    main()
