"""CPSR's numbers (recovery, plans, checkpoint costs) to DeepSpeed's monitor, where the config enables one."""

from __future__ import annotations

import logging

from cpsr_ds.recovery import RecoveryReport

log = logging.getLogger(__name__)


class Monitor:
    """Writes events to ``engine.monitor`` on rank 0 where it is enabled; elsewhere nothing."""

    def __init__(self, engine, rank: int):
        self.monitor = engine.monitor if rank == 0 and engine.monitor.enabled else None

    def write(self, events: list, step: int) -> None:
        """``events`` ((name, value)) at ``step``."""
        if self.monitor is None:
            return
        try:
            self.monitor.write_events([(name, value, step) for name, value in events])
        except Exception as err:  # a monitor's failure must not stop training
            log.warning("cpsr: writing to DeepSpeed's monitor failed: %s", err)

    def recovery(self, report: RecoveryReport) -> None:
        """The recovery decision of this start."""
        if report.reached is None:
            return
        events = [("cpsr/recovery/predict", float(report.method == "predict")),
                  ("cpsr/recovery/d", float(report.lost_iterations))]
        if report.estimated_cost is not None:
            events.append(("cpsr/recovery/estimated_cost", float(report.estimated_cost)))
        self.write(events, report.resume_iteration)
