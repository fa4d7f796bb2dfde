"""Run by test_shard.py, one process per data-parallel replica of one stage (gloo on loopback): each
replica's predictor observes its share of the same checkpoints, then recovery decides and writes the
prediction into the replica's engine, which is saved with the decision for the test to check."""

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from cpsr_ds.checkpoint.capture.journal import read_progress  # noqa: E402
from cpsr_ds.config import CPSRConfig  # noqa: E402
from cpsr_ds.planning.fitter import stage_xi  # noqa: E402
from cpsr_ds.predictor import make_predictor  # noqa: E402
from cpsr_ds.recovery import engine_state, load_engine_state, own_share, state_shapes  # noqa: E402
from cpsr_ds.recovery.decision import _decide  # noqa: E402

C, F = 400, 420
HISTORY = (370, 380, 390, 400)


class Grid:
    """The data-parallel part of DeepSpeed's pipeline grid: every process of the job replicates one stage."""

    def get_data_parallel_rank(self):
        return dist.get_rank() if dist.is_initialized() else 0

    def get_data_parallel_world_size(self):
        return dist.get_world_size() if dist.is_initialized() else 1

    def get_data_parallel_group(self):
        return dist.group.WORLD if dist.is_initialized() else None


def stage_engine():
    """The engine surface recovery uses: a 5 x 3 weight and a bias (sizes that split unevenly), AdamW stepped once."""
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 5)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.001)
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return SimpleNamespace(module=module, optimizer=optimizer, lr_scheduler=None, stage_id=0, global_steps=C,
                           global_samples=C * 8, train_batch_size=lambda: 8, grid=Grid(), device=torch.device("cpu"))


def checkpoints(engine) -> dict[int, dict[str, torch.Tensor]]:
    """The stage's state at each checkpoint of HISTORY: a drift plus noise, the same in every process."""
    g = torch.Generator().manual_seed(1)
    out = {}
    for iteration in HISTORY:
        out[iteration] = {k: 0.01 * iteration + torch.randn(shape, generator=g).abs() * (0.1 if "sq" in k else 1.0)
                          for k, shape in state_shapes(engine).items()}
    return out


def main(directory: str, out: str) -> None:
    engine = stage_engine()
    states = checkpoints(engine)
    predictor = make_predictor("trend", history=len(HISTORY))
    for iteration in HISTORY:
        load_engine_state(engine, states[iteration])
        predictor.observe(iteration, own_share(engine))
    cfg = CPSRConfig.parse_block({"checkpoint": {"dir": directory}, "recovery": {"mode": "predict"}})
    report = _decide(engine, cfg, predictor, read_progress(directory), C, stage_xi(states[C]))
    torch.save({"report": report, "state": engine_state(engine), "own_error": predictor.validation_error().relative,
                "observed": sum(t.numel() for t in predictor.history.flats[-1].values())},
               os.path.join(out, f"rank{engine.grid.get_data_parallel_rank()}.pt"))


if __name__ == "__main__":
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PROBE_PORT']}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    main(sys.argv[1], sys.argv[2])
    # Both replicas finish before either closes its gloo pairs: in CI one replica once aborted at exit
    # ("terminate called without an active exception") after its peer had already gone.
    dist.barrier()
    dist.destroy_process_group()
