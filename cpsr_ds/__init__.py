"""cpsr_ds: Controlled Predicting-assisted Self-Recovery for DeepSpeed training."""

import logging
import sys

from cpsr_ds.config import ConfigError, CPSRConfig
from cpsr_ds.runtime.session import initialize

# The package's log lines ("cpsr: ...") go to stdout beside DeepSpeed's, whatever the script's logging setup.
_logger = logging.getLogger("cpsr_ds")
if not _logger.handlers:
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter("[cpsr_ds] %(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(logging.INFO)
    _logger.propagate = False

__version__ = "0.1.0"
__all__ = ["initialize", "CPSRConfig", "ConfigError", "__version__"]
