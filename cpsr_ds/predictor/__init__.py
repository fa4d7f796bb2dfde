"""CPSR's predictor (Sec. III-A): predicts a shard's training state at the failure
point from its checkpoint history, for predicting-based recovery.

``make_predictor(name, **options)`` builds one of :data:`PREDICTORS`: ``vitp`` (FDD +
VITP, the paper's predictor) or one of the simple extrapolations ``skip``,
``linear``, ``trend``, ``damped``, ``ridge``, all behind :class:`Predictor`. Pure torch and
numpy: no DeepSpeed here.
"""

from cpsr_ds.predictor.base import NotReady, Predictor, ValidationResult
from cpsr_ds.predictor.simple import DampedPredictor, LinearPredictor, RidgePredictor, SkipPredictor, TrendPredictor
from cpsr_ds.predictor.state import KINDS, MOMENTS, kind_of
from cpsr_ds.predictor.trainer import LossPoint, StepReport, VITPTrainer
from cpsr_ds.predictor.vitp import VITPPredictor

PREDICTORS: dict[str, type[Predictor]] = {
    cls.name: cls for cls in (SkipPredictor, LinearPredictor, TrendPredictor, DampedPredictor, RidgePredictor, VITPPredictor)
}


def make_predictor(name: str, **options) -> Predictor:
    """A new predictor by name, with its options (see each class)."""
    try:
        cls = PREDICTORS[name]
    except KeyError:
        raise ValueError(f"unknown predictor {name!r}; known: {', '.join(PREDICTORS)}") from None
    return cls(**options)


__all__ = [
    "KINDS", "MOMENTS", "PREDICTORS", "DampedPredictor", "LinearPredictor", "LossPoint", "NotReady", "Predictor",
    "RidgePredictor", "SkipPredictor", "StepReport", "TrendPredictor", "ValidationResult", "VITPPredictor", "VITPTrainer",
    "kind_of", "make_predictor",
]
