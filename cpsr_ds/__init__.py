"""cpsr_ds: Controlled Predicting-assisted Self-Recovery for DeepSpeed training."""

from cpsr_ds.config import ConfigError, CPSRConfig

__version__ = "0.1.0"
__all__ = ["initialize", "CPSRConfig", "ConfigError", "__version__"]


def __getattr__(name: str):
    """``initialize`` imports DeepSpeed on first use, so that ``python -m cpsr_ds`` can route DeepSpeed's
    logging to stderr before DeepSpeed binds it to stdout."""
    if name == "initialize":
        from cpsr_ds.plugin import initialize

        return initialize
    raise AttributeError(f"module 'cpsr_ds' has no attribute {name!r}")
