"""Data-parallel shares of a stage's state (cpsr_ds.integration.deepspeed.shard)."""

import math
import os
import sys

import dp_share_probe as probe
import pytest
import torch

from benchmarks.common.processes import JOB_ENV, finish, free_port, start
from conftest import ROOT
from cpsr_ds.checkpoint.capture.journal import ProgressJournal
from cpsr_ds.predictor import make_predictor
from cpsr_ds.recovery import worst_error
from cpsr_ds.integration.deepspeed.shard import assemble, pack, packed_length, shapes_of, share, span, unpack


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


def worst_cases():
    return [([0.2, 0.7, 0.4], 0.7), ([0.2], 0.2), ([0.2, None], None), ([0.9, math.nan, 0.1], math.nan)]


@pytest.mark.parametrize("errors, worst", worst_cases())
def test_the_stages_held_out_error_is_its_worst_replicas(errors, worst):
    got = worst_error(errors)
    assert got is worst or got == worst or (math.isnan(got) and math.isnan(worst))


def test_data_parallel_replicas_predict_their_shares_and_all_resume_with_the_stages_prediction(tmp_path):
    """Two replicas of a stage, each predicting its share with trend, hold the prediction for the whole stage
    that one predictor given all of it makes; the held-out error they decide on is the worse share's."""
    journal = ProgressJournal(str(tmp_path), rank=0)
    for i in range(1, probe.F + 1):
        journal.append(i, 3.0)
    journal.close()
    port = free_port()
    procs = [start([sys.executable, os.path.join(ROOT, "tests", "jobs", "dp_share_probe.py"), str(tmp_path), str(tmp_path)],
                   tmp_path / f"rank{r}.log", dict(os.environ, **JOB_ENV, RANK=str(r), WORLD_SIZE="2",
                                                   PROBE_PORT=str(port)))
             for r in range(2)]
    codes = finish(procs, 120)
    assert codes == [0, 0], "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    engine = probe.stage_engine()
    states = probe.checkpoints(engine)
    whole = make_predictor("trend", history=len(probe.HISTORY))
    for iteration in probe.HISTORY:
        whole.observe(iteration, states[iteration])
    expected = whole.predict(probe.F)
    # Per kind, the first replica holds 7 of the weight's 15 values and 2 of the bias's 5, the second the rest.
    assert [r["observed"] for r in ranks] == [3 * 9, 3 * 11]
    for r in ranks:
        report = r["report"]
        assert report.method == "predict" and report.resume_iteration == probe.F
        assert r["state"].keys() == expected.keys()
        for key, value in expected.items():
            assert value.shape == r["state"][key].shape
            assert torch.allclose(r["state"][key], value, rtol=1e-6, atol=0), key
    errors = [r["own_error"] for r in ranks]
    assert errors[0] != errors[1]
    assert [r["report"].relative_error for r in ranks] == [max(errors)] * 2


@pytest.mark.parametrize("name", ["vitp", "trend", "damped"])
def test_every_predictor_learns_and_predicts_on_a_replicas_share(name):
    options = dict(token_size=8, window=2, batch_chunks=4, d_model=8, heads=2, layers=1, min_train_steps=2) \
        if name == "vitp" else {}
    predictor = make_predictor(name, history=4, **options)
    states = {i: {k: t + 0.01 * i for k, t in stage_state().items()} for i in (10, 20, 30, 40)}
    for iteration, state in states.items():
        predictor.observe(iteration, share(state, 1, 3))
        if name == "vitp":
            predictor.step(n_steps=2)
    assert predictor.ready() and predictor.validation_error() is not None
    predicted = predictor.predict(45)
    own = share(states[40], 1, 3)
    assert {k: v.shape for k, v in predicted.items()} == {k: v.shape for k, v in own.items()}
    assert all(torch.isfinite(v).all() for v in predicted.values())
