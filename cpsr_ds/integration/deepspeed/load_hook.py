"""DeepSpeed's model-states check on load, made to read a file of ours by its header and not twice whole.

Checked against DeepSpeed 0.19.8, ``deepspeed/runtime/state_dict_factory.py``:
``SDLoaderBase.__init__`` calls ``check_ckpt_list``, which loads the first file of the
list whole (``self.checkpoint_engine.load(self.ckpt_list[0], ...)``) to compare its
``mp_world_size`` with the list's length, and throws it away; ``DeepSpeedEngine._load_checkpoint``
then loads the same file again (``SDLoaderFactory.get_sd_loader`` in ``runtime/engine.py``).
:func:`reading_each_file_once` replaces ``SDLoaderBase.check_ckpt_list`` on the class, for
the duration of a load only.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from cpsr_ds.checkpoint.storage import loading
from cpsr_ds.checkpoint.storage.fileformat import CheckpointError, read_skeleton


@contextlib.contextmanager
def reading_each_file_once():
    """Around DeepSpeed's ``load_checkpoint`` (the plugin's engine wraps it): a file loaded again gets what its
    first load returned.

    DeepSpeed's SDLoader loads every model-states file twice in a row: its
    ``check_ckpt_list`` reads the first file of each list whole to see its
    ``mp_world_size``, and throws it away. With pipeline layer files that is the module's
    weights read twice. The first load's result, unused by the check, serves the second
    (once); what is kept goes when the block ends.

    The first file of the list is ``mp_rank_00_model_states.pt`` on every pipeline stage,
    which without ZeRO holds stage 0's optimizer state: a later stage's rank would read it
    whole for one integer. Within the block the check reads that integer from the file's
    header instead (:func:`_check_from_header`).
    """
    from deepspeed.runtime.state_dict_factory import SDLoaderBase

    with loading.each_file_once():
        check = SDLoaderBase.check_ckpt_list
        SDLoaderBase.check_ckpt_list = lambda loader: _check_from_header(loader, check)
        try:
            yield
        finally:
            SDLoaderBase.check_ckpt_list = check


def _check_from_header(loader, check: Callable) -> None:
    """DeepSpeed's ``SDLoaderBase.check_ckpt_list`` (``check``) on the header of a file in our format: the list
    holds as many files as the first one's ``mp_world_size`` says."""
    found = read_skeleton(loader.ckpt_list[0]) if loader.ckpt_list else None
    if found is None or not isinstance(found[0], dict):
        return check(loader)
    skeleton, header_bytes = found
    loading.count_loaded(header_bytes)
    saved = skeleton.get("mp_world_size")
    if saved is not None and len(loader.ckpt_list) != saved:
        raise CheckpointError(f"{loader.ckpt_list[0]}: checkpoint count {len(loader.ckpt_list)} is different from "
                              f"saved mp_world_size {saved}")
