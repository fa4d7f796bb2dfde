"""The prediction source (PB-R, Section III-A): the predictor, which observes this rank's share of the retained
history as it is loaded (:mod:`.checkpoint`), and its share of the state predicted at the failure point."""

from __future__ import annotations

import logging

import torch

from cpsr_ds.config import CPSRConfig
from cpsr_ds.planning.cost_model import SKIP
from cpsr_ds.predictor import NotReady, make_predictor
from cpsr_ds.recovery.validate import Spec, clamp_second_moments, problem

log = logging.getLogger(__name__)

PREDICTOR_STATE = "cpsr_predictor"  # key of the predictor's weights in DeepSpeed's client state


def new_predictor(cfg: CPSRConfig, shards: int = 1):
    """The configured predictor of one rank; ``shards``: the data-parallel replicas of its stage, each predicting
    its own share of the stage's state."""
    p = cfg.predictor
    device = {} if p.device == "cpu" else {"device": rank_gpu()}
    predictor = make_predictor(p.name, history=p.history, params=p.params, moments=p.moments, **device)
    if hasattr(predictor, "cap_memory"):  # a learning predictor: its memory on its device is capped ...
        predictor.cap_memory(p.memory_mb)
        predictor.split_work(shards)  # ... and its training split across the replicas
        if cfg.coordinator.fill:
            predictor.reserve_fill_check()
    return predictor


def rank_gpu() -> str:
    """``predictor.device: cuda`` as this rank's GPU (DeepSpeed set it current). A name, not a torch.device: it
    is one of the options saved with the predictor's weights."""
    if not torch.cuda.is_available():
        raise RuntimeError("cpsr: predictor.device is cuda, but this process sees no CUDA device; set it to cpu")
    return f"cuda:{torch.cuda.current_device()}"


def load_weights(predictor, client_state: dict) -> None:
    """Where the checkpoint carries a predictor of ``predictor``'s kind, its weights (the first data-parallel
    rank's, which wrote the checkpoint's client state); the history ``predictor`` has observed stays."""
    saved = client_state.get(PREDICTOR_STATE, {})
    if saved.get("name") == predictor.name:
        predictor.load_state_dict({**saved, "history": predictor.history.state_dict()})


def predicted_share(predictor, f: int, expected: dict[str, Spec]) -> tuple[str | None, dict | None]:
    """This rank's (reason it cannot predict, None) or (None, its share of the predicted state at f), which must
    pass :func:`~cpsr_ds.recovery.validate.problem` against ``expected`` (validate.share_specs: what the engine
    holds of it) once its negative second moments are clamped to zero (see :mod:`cpsr_ds.recovery.validate`)."""
    try:
        predicted = predictor.predict(f, kept_views=True)
    except NotReady as err:
        return str(err), None
    predicted, clamped = clamp_second_moments(predicted)
    if clamped:
        log.warning("cpsr recovery: %s predicted %d negative values of Adam's second moments (exp_avg_sq) at "
                    "iteration %d: set to zero", predictor.name, clamped, f)
    bad = problem(predicted, expected)
    if bad is not None:
        return f"the predicted state has {bad}", None
    return None, predicted


def checkpoint_as_prediction(predictor):
    """``skip`` over ``predictor``'s history: the state at c taken as the state at f, resumed at f. The cheapest
    prediction left where ``predictor`` diverges, since its held-out error is measured against exactly this."""
    skip = make_predictor(SKIP, history=1)
    skip.history = predictor.history
    return skip
