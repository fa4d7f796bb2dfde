"""cpsr_ds: Controlled Predicting-assisted Self-Recovery for DeepSpeed training."""

import logging
import sys

from cpsr_ds.runtime.restart_time import mark_start  # first: a restart's time is counted from this import
from cpsr_ds.config import ConfigError, CPSRConfig

# The package's log lines ("cpsr: ...") go to stdout beside DeepSpeed's, whatever the script's logging setup.
_logger = logging.getLogger("cpsr_ds")
if not _logger.handlers:
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter("[cpsr_ds] %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
    _logger.propagate = False

__version__ = "0.1.0"
__all__ = ["initialize", "mark_start", "CPSRConfig", "ConfigError", "__version__"]


def __getattr__(name: str):
    """``initialize`` imports DeepSpeed on first use, so that ``python -m cpsr_ds`` can route DeepSpeed's
    logging to stderr before DeepSpeed binds it to stdout."""
    if name == "initialize":
        from cpsr_ds.runtime.session import initialize

        return initialize
    raise AttributeError(f"module 'cpsr_ds' has no attribute {name!r}")
