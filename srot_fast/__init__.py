"""srot_fast: optimal transport robust to type-I and type-II outliers (SROT).

Public API:
    sinkhorn          log-domain (unbalanced / partial) Sinkhorn with optional soft-cost offsets
    SROTLoss          GeomLoss-style loss module with hard / soft SROT reweighting
    OutlierDetector   VAT (or CE-only) source-vs-target classifier that flags outliers
    DetectorFileError raised by OutlierDetector.load on a malformed file
    hard_weights, soft_offsets, outlier_masks   SROT reweighting from detector scores
    available_backends
"""
from .backends import available_backends
from .sinkhorn import ConvergenceWarning, SinkhornResult, sinkhorn
from .weights import hard_weights, outlier_masks, soft_offsets

__version__ = "0.1.0"

__all__ = [
    "sinkhorn",
    "SinkhornResult",
    "ConvergenceWarning",
    "SROTLoss",
    "OutlierDetector",
    "DetectorFileError",
    "hard_weights",
    "soft_offsets",
    "outlier_masks",
    "available_backends",
    "__version__",
]


def __getattr__(name):  # lazy: the loss and detector pull in more modules
    if name == "SROTLoss":
        from .loss import SROTLoss

        return SROTLoss
    if name == "OutlierDetector":
        from .detector import OutlierDetector

        return OutlierDetector
    if name == "DetectorFileError":
        from .detector import DetectorFileError

        return DetectorFileError
    raise AttributeError(f"module 'srot_fast' has no attribute {name!r}")
