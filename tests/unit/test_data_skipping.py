"""The engine's loader is fast-forwarded by its sampler: the skipped samples are never loaded, and only the first
pass after a restart is shortened."""

import torch
from torch.utils.data import DataLoader, DistributedSampler

from cpsr_ds.integration.deepspeed.data_iterator import Skipping, batches_in


class Counted(torch.utils.data.Dataset):
    """Samples 0..n-1 that record which ones were loaded."""

    def __init__(self, n: int):
        self.n, self.loaded = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loaded.append(i)
        return i


def test_a_skipping_sampler_starts_its_next_pass_in_without_loading_the_skipped_samples():
    data = Counted(20)
    sampler = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    whole = [int(i) for batch in DataLoader(data, batch_size=2, sampler=sampler) for i in batch]
    data.loaded.clear()
    loader = DataLoader(data, batch_size=2, sampler=Skipping(sampler, 3 * 2))
    assert [int(i) for batch in loader for i in batch] == whole[6:]
    assert data.loaded == whole[6:]
    assert [int(i) for batch in loader for i in batch] == whole


def test_the_position_after_steps_wraps_at_the_passes_length():
    assert batches_in(steps=6, accumulation=2, length=18) == 12
    assert batches_in(steps=9, accumulation=2, length=18) == 0
    assert batches_in(steps=10, accumulation=2, length=9) == 2
