"""Where a rank sits in DeepSpeed's pipeline: its stage, its data-parallel replica, every rank's stage.

DeepSpeed 0.19.8 keeps the process topology in private fields: runtime/pipe/module.py PipelineModule._topo and
runtime/pipe/topology.py PipelineParallelGrid._topo (a ProcessTopology; get_coord(rank).pipe is a rank's stage).
"""

from __future__ import annotations

from typing import NamedTuple


class Place(NamedTuple):
    """This rank's place in the job."""

    rank: int
    world: int
    stage: int
    stages: int
    measuring: bool  # the first data-parallel (and tensor-parallel) rank of its stage, which measures for it
    rank_stages: tuple[int, ...]  # every rank's pipeline stage, by rank


def place_of(engine) -> Place:
    grid = engine.grid
    measuring = grid.get_data_parallel_rank() == 0 and grid.get_slice_parallel_rank() == 0
    stages = tuple(grid._topo.get_coord(r).pipe for r in range(engine.world_size))
    return Place(engine.global_rank, engine.world_size, engine.stage_id, engine.num_stages, measuring, stages)


def tensor_parallel_size(model) -> int:
    """The tensor-parallel degree of a pipeline ``model`` (1 where its topology has no "model" axis)."""
    topology = model._topo
    return topology.get_dim("model") if "model" in topology.get_axis_names() else 1
