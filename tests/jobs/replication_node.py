"""One rank of a two-node job on one machine, checkpointing through node-local directories with replication.

    python tests/jobs/replication_node.py RANK PORT DIR0 DIR1 LOSE_AT

Each rank checkpoints global_step5 then global_step10 into its node's directory. Rank 1
dies (os._exit) the moment it would start sending its part of global_step``LOSE_AT``:
the node lost within the replication window. Every rank prints one JSON line: what
each ``flush`` returned. Started by tests/jobs/test_replication.py.
"""

import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cpsr_ds.checkpoint.storage import replica, topology# noqa: E402
from cpsr_ds.checkpoint.engines.factory import create_engine  # noqa: E402
from support.checkpoints import checkpoint, config, states


def main(rank: int, port: int, dirs: list[str], lose_at: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = config(dirs[rank], storage="node_local", commit_timeout_s=240.0)
    topology.verify_storage(cfg)
    send_part = replica._send_part

    def dying_send(group, ckpt_dir, tag, *args, **kw):
        if rank == 1 and tag == f"global_step{lose_at}":
            os._exit(3)
        return send_part(group, ckpt_dir, tag, *args, **kw)

    replica._send_part = dying_send
    eng = create_engine(cfg, rank, 2)
    flushed = []
    for step in (5, 10):
        checkpoint(eng, dirs[rank], step, states(n=200_000), rank=rank)
        flushed.append(eng.flush(30))
    eng.cleanup()
    print(json.dumps({"rank": rank, "flushed": flushed}), flush=True)
    # A peer may be gone: tearing the process group down would wait for it.
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:5], int(sys.argv[5]))
