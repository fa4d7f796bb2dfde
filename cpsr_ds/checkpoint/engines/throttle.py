"""A storage write-rate limit (``checkpoint.write_mbps``): one token bucket per process.

Every checkpoint file a process writes draws on the same bucket, so checkpoints
persisting at once (pccheck's, or several engines') share the rate rather than each
getting it. Writers wait in the thread that writes: the asynchronous engines' writer
threads, never their training loop; the ``torch`` engine writes in the training loop,
so there training waits, as on slow storage.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

MB = 10**6  # write_mbps is in MB/s, decimal as storage is rated
BURST_S = 0.05  # the most the bucket lets through at once, in seconds of the rate
MAX_BURST = 1 << 20  # ...and in bytes: the piece a write is cut into


class Throttle:
    """At most ``bytes_per_s`` on average over any span, ``burst`` bytes at once; shared by threads."""

    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.bytes_per_s = bytes_per_s
        self.burst = int(min(MAX_BURST, bytes_per_s * BURST_S))
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        # When the bytes granted so far have passed at the rate (the bucket is full from then on).
        self._drained = clock()

    def take(self, nbytes: int) -> float:
        """Wait until ``nbytes`` more fit the rate; the seconds waited."""
        with self._lock:
            now = self._clock()
            # Granting in order under the lock, sleeping outside it: each writer waits its own turn.
            self._drained = max(self._drained, now) + nbytes / self.bytes_per_s
            wait = self._drained - self.burst / self.bytes_per_s - now
        if wait > 0:
            self._sleep(wait)
        return max(wait, 0.0)


_shared: dict[float, Throttle] = {}
_shared_lock = threading.Lock()


def shared(write_mbps: Optional[float]) -> Optional[Throttle]:
    """This process's throttle for ``write_mbps`` (MB/s, 10^6 bytes/s); None where the rate is unlimited."""
    if write_mbps is None:
        return None
    with _shared_lock:
        return _shared.setdefault(write_mbps, Throttle(write_mbps * MB))
