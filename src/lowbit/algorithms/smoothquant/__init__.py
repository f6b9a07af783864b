"""SmoothQuant: per-channel smoothing folded into norms (and up_proj) and linear weights."""

from lowbit.algorithms.smoothquant.fold import fold_smoothing, smooth_scales
from lowbit.algorithms.smoothquant.mappings import MAPPINGS, SmoothMapping, SourceKind, mappings_for, model_type
from lowbit.algorithms.smoothquant.search import search_alpha, smoothing_error

__all__ = ["fold_smoothing", "smooth_scales", "MAPPINGS", "SmoothMapping", "SourceKind", "mappings_for",
           "model_type", "search_alpha", "smoothing_error"]
