"""The failure classes and their shares: which state a failure leaves, and so which sources can serve it.

- ``process_crash``: the training process dies, its node lives (a software bug, a NCCL timeout, a
  link that comes back): host memory and node-local disk survive, so a host snapshot serves it;
- ``node_lost``: the rank goes with its node (a GPU, host or power fault, unplanned maintenance):
  its host memory and node-local disk are gone, the other nodes live; only storage (or a replica
  on another node) holds its state, the survivors' dumps hold theirs.

The default shares come from a production trace: "The Llama 3 Herd of Models" (Llama Team, AI @
Meta, 2024), section 3.3.4, Table 5: 466 job interruptions in 54 days of pre-training on 16,384
H100 GPUs, 47 planned, 419 unexpected, by root cause (LLAMA3_CAUSES). Planned interruptions are
left out: a job checkpoints before them. Each cause is mapped to the class its fault leaves
(LLAMA3_CLASS); the paper's 30.1 % for "Faulty GPU" is not 148 / 419 (35.3 %): the counts are used.
"""

from __future__ import annotations

from collections import Counter

from cpsr_ds.planning.units import finite, non_negative

PROCESS_CRASH = "process_crash"
NODE_LOST = "node_lost"
CLASSES = (PROCESS_CRASH, NODE_LOST)

# Table 5 of the Llama 3 report: root cause -> unexpected interruptions in 54 days.
LLAMA3_CAUSES = {
    "Faulty GPU": 148, "GPU HBM3 Memory": 72, "Software Bug": 54, "Network Switch/Cable": 35,
    "Host Maintenance": 32, "GPU SRAM Memory": 19, "GPU System Processor": 17, "NIC": 7,
    "NCCL Watchdog Timeouts": 7, "Silent Data Corruption": 6, "GPU Thermal Interface + Sensor": 6, "SSD": 3,
    "Power Supply": 3, "Server Chassis": 2, "IO Expansion Board": 2, "Dependency": 2, "CPU": 2,
    "System Memory": 2,
}
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
# A fault in the GPU or the host takes the node out of the job (it is drained and replaced, its memory
# with it); software, dependency, NCCL timeouts and the network fail the process on a node that lives.
LLAMA3_CLASS = {cause: PROCESS_CRASH if cause in ("Software Bug", "Dependency", "NCCL Watchdog Timeouts",
                                                 "Network Switch/Cable") else NODE_LOST
                for cause in LLAMA3_CAUSES}


def shares_from_causes(causes: dict, classes: dict) -> dict:
    """Each class's share of the failures, from counts per cause and each cause's class."""
    missing = sorted(set(causes) - set(classes))
    if missing:
        raise ValueError(f"causes without a failure class: {', '.join(missing)}")
    counts = Counter()
    for cause, n in causes.items():
        counts[classes[cause]] += non_negative(f"count of {cause!r}", n)
    total = sum(counts.values())
    if total <= 0:
        raise ValueError("no failures counted: the shares are undefined")
    return {c: counts[c] / total for c in CLASSES}


LLAMA3_SHARES = shares_from_causes(LLAMA3_CAUSES, LLAMA3_CLASS)
# The Llama 3 job's own rate: unexpected interruptions per hour of the 16,384-GPU job.
LLAMA3_RATE_PER_HOUR = sum(LLAMA3_CAUSES.values()) / (LLAMA3_DAYS * 24)


def check_shares(shares: dict) -> dict:
    """``shares`` (class -> share of failures) when every class is named, each in [0, 1], summing to 1."""
    unknown = sorted(set(shares) - set(CLASSES))
    missing = sorted(set(CLASSES) - set(shares))
    if unknown or missing:
        raise ValueError(f"failure classes are {', '.join(CLASSES)}: unknown {unknown}, missing {missing}")
    for name, share in shares.items():
        if not 0 <= finite(name, share) <= 1:
            raise ValueError(f"share of {name} must be in [0, 1], got {share!r}")
    if abs(sum(shares.values()) - 1) > 1e-6:
        raise ValueError(f"the shares of the failure classes must sum to 1, got {sum(shares.values())!r}")
    return dict(shares)


def class_rates(rate: float, shares: dict) -> dict:
    """Each class's failure rate: the job's rate times its share (in the rate's unit)."""
    non_negative("rate", rate)
    return {c: rate * s for c, s in check_shares(shares).items()}
