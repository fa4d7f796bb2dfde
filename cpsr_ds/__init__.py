"""cpsr_ds: Controlled Predicting-assisted Self-Recovery for DeepSpeed training."""

from cpsr_ds.config import ConfigError, CPSRConfig
from cpsr_ds.plugin import initialize

__version__ = "0.1.0"
__all__ = ["initialize", "CPSRConfig", "ConfigError", "__version__"]
