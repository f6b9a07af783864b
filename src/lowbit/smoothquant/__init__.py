"""SmoothQuant: per-channel smoothing folded into norms (and up_proj) and linear weights."""

from lowbit.smoothquant.fold import fold_smoothing, smooth_scales
from lowbit.smoothquant.mappings import MAPPINGS, SmoothMapping, SourceKind, mappings_for, model_type
from lowbit.smoothquant.search import search_alpha, smoothing_error

__all__ = ["fold_smoothing", "smooth_scales", "MAPPINGS", "SmoothMapping", "SourceKind", "mappings_for",
           "model_type", "search_alpha", "smoothing_error"]
