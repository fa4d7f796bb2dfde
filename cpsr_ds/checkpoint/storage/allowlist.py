"""The types a checkpoint file may name when it is unpickled, and the loaders that refuse every other.

Unpickling calls whatever the pickle names, so a planted file naming ``os.system`` runs
a command as whoever reads it. Our snapshot headers are read by an unpickler that
resolves only :data:`ALLOWED` (and torch's dtypes); ``torch.save`` files (DeepSpeed's own
engine's, the ``torch`` strategy's) by ``torch.load(weights_only=True)``, which allows
torch's own types, with :data:`ALLOWED` added. Writers check their header the same way
(:func:`dumps`), so that no checkpoint is written that a restart would refuse.
"""

from __future__ import annotations

import importlib
import io
import pickle
from typing import Any

import torch

# The DeepSpeed classes in the state dicts DeepSpeed 0.19.8 saves: the globals of every file of real checkpoints
# of the tiny GPT (pipeline fp32; ZeRO-1 fp32 and bf16, pipeline and data parallel), both file formats.
DEEPSPEED = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",  # the ZeRO and bf16 optimizers' loss_scaler
    # the same under fp16's dynamic loss scaling (DeepSpeedZeroOptimizer.state_dict; fp16 needs a GPU)
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",  # the optimizers' zero_stage
    "deepspeed.utils.tensor_fragment.fragment_address",  # their param_slice_mappings
)
# Every global a header may name, as ``module.name``; torch's dtypes besides (``torch.float32``).
ALLOWED = frozenset({
    "cpsr_ds.checkpoint.storage.fileformat.TensorRef", "cpsr_ds.checkpoint.storage.fileformat.TensorSpec",
    "collections.OrderedDict", "torch.Size", "builtins.set", "builtins.frozenset", "builtins.slice", *DEEPSPEED,
})


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle names a global outside the allowlist; the message names it."""

    def __init__(self, names: list[str]):
        super().__init__(f"it names {', '.join(names)}, which a checkpoint may not hold (allowed: "
                         "cpsr_ds/checkpoint/storage/allowlist.py, see docs/security.md)")
        self.names = names


class _Restricted(pickle.Unpickler):
    """An unpickler that resolves the globals of :data:`ALLOWED` and torch's dtypes, and no other."""

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise RefusedGlobal([f"{module}.{name}"])


def loads(data: bytes) -> Any:
    """Unpickle ``data``, refusing (:class:`RefusedGlobal`) any global outside the allowlist."""
    return _Restricted(io.BytesIO(data)).load()


def dumps(obj: Any) -> bytes:
    """Pickle ``obj``; raises :class:`RefusedGlobal` where :func:`loads` would refuse the result."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    loads(data)
    return data


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _allow_in_torch() -> None:
    """Add :data:`ALLOWED` to torch's weights-only allowlist. It is one set per process, which torch's
    ``safe_globals`` block would put back on leaving, under another thread's load: added, never removed."""
    torch.serialization.add_safe_globals([_resolve(name) for name in sorted(ALLOWED)])


def torch_load(source, map_location: Any = None) -> Any:
    """``torch.load`` of a ``torch.save`` file (a path or a seekable file) with the weights-only unpickler;
    :class:`RefusedGlobal` where it names a global outside torch's and our allowlists."""
    _allow_in_torch()
    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        refused = _unsafe_globals(source)
        if refused:
            raise RefusedGlobal(refused) from err
        raise


def _unsafe_globals(source) -> list[str]:
    """The globals of a ``torch.save`` file that :func:`torch_load` refuses, sorted; [] where none or unreadable."""
    if hasattr(source, "seek"):
        source.seek(0)
    _allow_in_torch()
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except (ValueError, RuntimeError, pickle.UnpicklingError, EOFError):
        return []
