"""Checkpoints written by the product's writers and engines, damaged or split across nodes, and their checks: what the
store, engine, storage, damage and file-format tests share."""

import collections
import json
import os
import shutil
import threading
import time

import deepspeed
import pytest
import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from benchmarks.common.processes import free_port
from cpsr_ds.cli import main
from cpsr_ds.checkpoint.capture import dumps, host_snapshot, run_id
from cpsr_ds.checkpoint.capture.journal import ProgressJournal
from cpsr_ds.checkpoint.engines.factory import create_engine
from cpsr_ds.checkpoint.engines.snapshot import HostBuffers, snapshot_file
from cpsr_ds.checkpoint.storage import committing, layout, ondisk, records, topology
from cpsr_ds.checkpoint.storage.filesystem import fs
from cpsr_ds.config import CheckpointConfig, CPSRConfig


# ---------------------------------------------------------------- files in a checkpoint directory

def nested_state():
    """A state dict with the types of DeepSpeed's; a file may hold no others (allowlist.py)."""
    return {
        "module": collections.OrderedDict(w=torch.randn(7, 5), b=torch.arange(4, dtype=torch.int64)),
        "optimizer": {"state": {0: {"exp_avg": torch.randn(3).to(torch.bfloat16), "step": torch.tensor(3.0)}},
                      "param_groups": [{"lr": 1e-3, "params": [0]}]},
        "pair": (torch.ones(2, 2).t(), "x"),
        "shapes": collections.OrderedDict(w=torch.Size([7, 5])),
        "mask": torch.tensor([True, False]),
        "plain": ("text", 3, None),
    }


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def write_snapshot(path, state, chunk_bytes=None):
    snap = snapshot_file(os.path.basename(path), state, HostBuffers(pin=False), chunk_bytes)
    snap.copy(None)
    return fs.write_atomic(path, snap.chunks(), "xxh3_64")


def make_checkpoint(ckpt_dir, tag, world_size=2, commit=True, attempt=0, started_ns=0):
    """A committed checkpoint of ``world_size`` ranks, one file each, as the engine lays it out."""
    tag_dir = os.path.join(ckpt_dir, tag)
    os.makedirs(tag_dir, exist_ok=True)
    for rank in range(world_size):
        name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        size, digest = write_snapshot(os.path.join(tag_dir, name), {"rank": rank, "x": torch.full((50,), rank / 2)})
        fs.write_json_atomic(os.path.join(tag_dir, ondisk.manifest_name(rank)), {
            "tag": tag, "rank": rank, "world_size": world_size, "started_ns": started_ns, "attempt": attempt,
            "iteration": ondisk.tag_iteration(tag), "checksum": "xxh3_64",
            "files": {name: {"size": size, "digest": digest}}})
    if commit:
        committing.commit_checkpoint(ckpt_dir, tag, {"tag": tag, "world_size": world_size, "started_ns": started_ns,
                                                "attempt": attempt, "iteration": ondisk.tag_iteration(tag)})


@pytest.fixture
def two_checkpoints(tmp_path):
    make_checkpoint(str(tmp_path), "global_step10")
    make_checkpoint(str(tmp_path), "global_step20")
    assert records.read_latest(str(tmp_path)) == "global_step20"
    return str(tmp_path)


# ---------------------------------------------------------------- engines through the factory

MODEL = "mp_rank_00_model_states.pt"


def optim(rank):
    return f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def config(d, **kw):
    kw = {"dir": d, "retries": 2, "retry_backoff_s": 0.01, "chunk_mb": 1, "commit_timeout_s": 30.0, **kw}
    return CheckpointConfig(**kw)


@pytest.fixture
def engines():
    made = []

    def make(d, rank=0, world_size=1, keywords=None, **kw):
        """An engine through the factory; ``keywords``: its attempt and min_keep."""
        eng = create_engine(config(d, **kw), rank, world_size, **(keywords or {}))
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.cleanup()


def checkpoint(eng, d, step, states, rank=0):
    """What DeepSpeed's save_checkpoint and the next step do with a decoupled engine."""
    tag = f"global_step{step}"
    eng.makedirs(d, exist_ok=True)
    eng.create(CheckpointCommitInfo(tag=tag, save_dir=d, save_latest=True))
    eng.makedirs(os.path.join(d, tag), exist_ok=True)
    if rank == 0:
        eng.save(states["model"], os.path.join(d, tag, MODEL))
    eng.save(states["optim"], os.path.join(d, tag, optim(rank)))
    info = eng.get_commit_info()
    assert info.tag == tag and info.save_latest is False
    eng.commit(info)
    return tag


def states(scale=1.0, n=50_000):
    return {"model": nested_state(), "optim": {"fp32": torch.randn(n) * scale, "step": 7}}


@pytest.fixture
def hung_storage(monkeypatch):
    """``hang()`` makes every later file write wait until the test ends or the function it returns is called."""
    answer = threading.Event()
    write_atomic = fs.write_atomic

    def hung(*args, **kw):
        answer.wait()
        return write_atomic(*args, **kw)

    def hang():
        monkeypatch.setattr(fs, "write_atomic", hung)
        return answer.set

    yield hang
    answer.set()


def open_checkpoint(eng, d, step, rank=0):
    """create() and save() of rank ``rank``'s part, not yet committed: the checkpoint is in flight."""
    tag = f"global_step{step}"
    eng.create(CheckpointCommitInfo(tag=tag, save_dir=d, save_latest=True))
    os.makedirs(os.path.join(d, tag), exist_ok=True)
    eng.save(states()["optim"], os.path.join(d, tag, optim(rank)))


def timed_cleanup(eng, limit_s=30.0) -> float:
    """Seconds ``eng.cleanup()`` took (run on a thread, so that a hang fails the test instead of stalling it)."""
    closing = threading.Thread(target=eng.cleanup, daemon=True)
    t0 = time.monotonic()
    closing.start()
    closing.join(limit_s)
    assert not closing.is_alive(), f"cleanup still waiting after {limit_s} s"
    return time.monotonic() - t0


# ---------------------------------------------------------------- two nodes, a directory each

TWO_NODES = topology.Nodes(((0,), (1,)), run="test")


@pytest.fixture
def node_engines(tmp_path):
    """make(**kw): one engine per node, ranks 0 and 1, each on a directory of its own, talking through one store."""
    made = []
    kv = dist.HashStore()

    def make(**kw):
        dirs = [str(tmp_path / f"node{n}") for n in (0, 1)]
        for rank, d in enumerate(dirs):
            cfg = config(d, storage="node_local", **kw)
            made.append(create_engine(cfg, rank, 2, layout=layout.make_layout(cfg, rank, 2, kv=kv, nodes=TWO_NODES)))
        return dirs, made[-2:]

    yield make
    # Rank 0 ends only once the others released the store, so they go first.
    for eng in reversed(made):
        eng.cleanup()


def both(engines, dirs, step, st=None):
    for rank, (eng, d) in enumerate(zip(engines, dirs)):
        checkpoint(eng, d, step, st or states(n=100), rank=rank)
    assert all(eng.flush(30) for eng in engines)


def replicate(dirs, tag):
    """What replication leaves: each node's part of ``tag`` also under the next node's replicas/."""
    for n, d in enumerate(dirs):
        shutil.copytree(os.path.join(d, tag), os.path.join(dirs[(n + 1) % len(dirs)], ondisk.REPLICAS, tag))


def journal(d, rank, last):
    j = ProgressJournal(d, rank)
    for i in range(1, last + 1):
        j.append(i, 5.0 - i / 10)
    j.close()


def start_token(d, rank, run="run-1"):
    os.makedirs(os.path.join(d, topology.TOKENS), exist_ok=True)
    with open(os.path.join(d, topology.TOKENS, f"rank{rank:05d}"), "w") as f:
        f.write(run)


@pytest.fixture
def two_nodes(node_engines):
    """Nodes 0 and 1 (a rank each): global_step5 and global_step10 committed and replicated, journals to 12 and 11."""
    dirs, engines = node_engines()
    for step in (5, 10):
        both(engines, dirs, step)
        replicate(dirs, f"global_step{step}")
    for rank, d in enumerate(dirs):
        journal(d, rank, 12 - rank)
        start_token(d, rank)
    return dirs


# ---------------------------------------------------------------- damage and inspection

NEW = "global_step20"
RANK1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def run_inspect(ckpt_dir, capsys, *flags):
    """``python -m cpsr_ds inspect`` as a table, then as JSON; returns the JSON report, rows by tag."""
    assert main(["inspect", ckpt_dir, *flags]) == 0
    table = capsys.readouterr().out
    assert main(["inspect", ckpt_dir, "--json", *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    report["rows"] = {r["tag"]: r for r in report["checkpoints"]}
    report["table"] = table
    return report


def edit_json(path, change):
    with open(path) as f:
        obj = json.load(f)
    change(obj)
    write(path, json.dumps(obj).encode())


def deepspeed_checkpoint(ckpt_dir, tag, state):
    os.makedirs(os.path.join(ckpt_dir, tag))
    torch.save(state, os.path.join(ckpt_dir, tag, "mp_rank_00_model_states.pt"))
    write(os.path.join(ckpt_dir, ondisk.LATEST), tag.encode())


# ---------------------------------------------------------------- DeepSpeed's torch engine

@pytest.fixture
def process_group():
    """One process group of world size 1 for the test (DeepSpeed's torch engine saves through it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    yield
    deepspeed.comm.destroy_process_group()  # torch's, and the groups DeepSpeed cached from it


def landed_snapshots(config: dict, rank: int) -> set[int]:
    """The iterations of ``rank``'s host snapshots in place (verified) in the run of ``config``."""
    cfg = CPSRConfig.parse_block(config["cpsr"]).checkpoint
    root, run = dumps.survivor_root(cfg), run_id.run_identity(cfg.dir)
    found = [dumps.read_dump(host_snapshot.snapshot_dir(root, run, rank, slot), rank, run, None, host_snapshot.WHAT)
             for slot in range(host_snapshot.SLOTS)]
    return {snap.iteration for snap in found if snap is not None}
