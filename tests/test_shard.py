"""Data-parallel shares of a stage's state (cpsr_ds.shard)."""

import pytest
import torch

from cpsr_ds.shard import assemble, pack, packed_length, shapes_of, share, span, unpack


def stage_state():
    g = torch.Generator().manual_seed(0)
    return {"param/w": torch.randn(5, 7, generator=g), "exp_avg/w": torch.randn(5, 7, generator=g),
            "param/b": torch.randn(3, generator=g), "param/one": torch.randn(1, generator=g)}


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shares_assemble_back_into_the_state(size):
    state = stage_state()
    shares = [share(state, r, size) for r in range(size)]
    back = assemble(shares, shapes_of(state))
    assert set(back) == set(state)
    for k, t in state.items():
        assert back[k].shape == t.shape and torch.equal(back[k], t)


@pytest.mark.parametrize("numel, size", [(35, 2), (35, 4), (3, 4), (1, 2), (0, 3), (64, 8)])
def test_every_element_is_owned_by_exactly_one_rank_the_last_taking_the_remainder(numel, size):
    owned = torch.zeros(numel, dtype=torch.int64)
    lengths = []
    for r in range(size):
        s = span(numel, r, size)
        owned[s] += 1
        lengths.append(s.stop - s.start)
    assert torch.all(owned == 1)
    assert lengths[:-1] == [numel // size] * (size - 1) and lengths[-1] == numel - (size - 1) * (numel // size)


def test_a_share_is_1d_slices_under_the_same_keys_not_views_of_the_state():
    state = stage_state()
    own = share(state, 1, 2)
    assert set(own) == set(state)
    assert all(t.dim() == 1 for t in own.values())
    assert torch.equal(own["param/w"], state["param/w"].reshape(-1)[17:])
    assert own["param/one"].numel() == 1 and share(state, 0, 2)["param/one"].numel() == 0
    state["param/w"].zero_()
    assert own["param/w"].abs().sum() > 0


def test_one_rank_owns_the_state_as_it_is():
    state = stage_state()
    assert share(state, 0, 1) is state


def test_a_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        span(10, 2, 2)


@pytest.mark.parametrize("size", [1, 3])
def test_packed_shares_unpack_by_the_shapes_alone(size):
    state = stage_state()
    shapes = shapes_of(state)
    for r in range(size):
        flat = pack(share(state, r, size))
        assert flat.numel() == packed_length(shapes, r, size)
        own = unpack(flat, shapes, r, size)
        assert all(torch.equal(own[k], share(state, r, size)[k].reshape(-1)) for k in state)
