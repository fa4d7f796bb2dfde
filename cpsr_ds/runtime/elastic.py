"""Whether torch's elastic agent (torchrun) can restart this job's workers onto a working process group.

torchrun's agent shares one TCPStore with its workers (``TORCHELASTIC_USE_AGENT_STORE=True``,
the default of the c10d rendezvous since torch 2.5, and always with the static one)
and keeps it, with everything the workers wrote into it, for every restart round:
the workers' side (``torch.distributed.rendezvous``) assumes a new store per round and
adds no prefix of its own. A restarted worker then reads its peers' gloo (or NCCL)
addresses of the failed round, and its process group fails with ``Gloo
connectFullMesh failed ... Connection refused``. No round number reaches the workers
(``TORCHELASTIC_RESTART_COUNT`` is counted per agent, and an agent that restarts for a
node waiting to join does not count), so the workers cannot pick a namespace of their
own; with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment, rank 0's
agent gives every round its own master port and rank 0's worker a new store on it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

STORE_SETTING = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def restart_problem(env: Mapping[str, str]) -> str | None:
    """Why a restart by torch's elastic agent would fail under ``env``; None where it can work."""
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        restarts = 0
    if not (shared and restarts > 0):
        return None
    return (f"torchrun runs this job with --max-restarts {restarts} on one TCPStore shared by every restart round "
            "(TORCHELASTIC_USE_AGENT_STORE=True): a restarted worker would read the failed round's addresses "
            "and stop with 'Gloo connectFullMesh failed ... Connection refused'. Start torchrun with "
            f"--rdzv-backend c10d and {STORE_SETTING} in its environment (every round then gets a store of its "
            "own), or with --max-restarts 0 under launch/resilient.sh")


def check_restartable(env: Mapping[str, str] = os.environ) -> None:
    """Stop before any process group exists where torchrun could not restart this job."""
    problem = restart_problem(env)
    if problem is not None:
        raise RuntimeError(f"cpsr_ds: {problem}")
