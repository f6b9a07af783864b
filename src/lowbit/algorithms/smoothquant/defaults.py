"""Which schemes SmoothQuant applies to by default, and with which alpha.

SmoothQuant moves activation outliers into the weights. It matters for schemes whose input
activations share one static scale per tensor (w8a8-int8, w8a8-fp8): one outlier channel sets
that scale for every token. Block and per-token scales handle outliers locally, so those schemes
are not smoothed unless asked.

The default alpha depends on the element format of the activations (chosen on SmolLM2-135M
perplexity: bench/quantize/RESULTS-quantize.md):
- INT8 (uniform grid; outliers cost resolution everywhere): alpha 0.8.
- FP8 E4M3 (relative precision; only the range is shared): alpha 0.5, which moves less
  difficulty into the weights.
"""

from __future__ import annotations

from lowbit.numerics import IntFormat, get_format
from lowbit.schemes import Dynamic, Granularity, Scheme

INT_ALPHA = 0.8
FLOAT_ALPHA = 0.5

DEFAULT = "default"  # the value (API, CLI, CompareOptions) that means "default_alpha(scheme)"; the default
OFF = "none"         # the value that means "no smoothing" (the Python API also takes None for it)
AUTO = "auto"        # per-layer alpha search


def smoothquant_applies(scheme: Scheme) -> bool:
    """Whether the scheme's input activations share one static scale per tensor."""
    a = scheme.input_activations
    return a is not None and a.dynamic is Dynamic.STATIC and a.granularity is Granularity.TENSOR


def default_alpha(scheme: Scheme) -> float | None:
    """The SmoothQuant alpha used for ``scheme`` when none is given (None: no smoothing)."""
    if not smoothquant_applies(scheme):
        return None
    return INT_ALPHA if isinstance(get_format(scheme.input_activations.format), IntFormat) else FLOAT_ALPHA


def check_choice(choice) -> float | str | None:
    """A user's SmoothQuant choice, checked: DEFAULT, OFF (or None), AUTO or an alpha in [0, 1].
    Returns it with OFF spelled None; anything else is a ValueError naming the accepted values."""
    if choice is None or (isinstance(choice, str) and choice == OFF):
        return None
    if isinstance(choice, str) and choice in (DEFAULT, AUTO):
        return choice
    if isinstance(choice, bool) or not isinstance(choice, (int, float)) or not 0.0 <= choice <= 1.0:
        raise ValueError(f"smoothquant must be an alpha in [0, 1], {AUTO!r}, {DEFAULT!r} or {OFF!r}, got {choice!r}")
    return float(choice)


def resolve_alpha(choice: float | str | None, scheme: Scheme) -> float | str | None:
    """The alpha for ``scheme`` given a user's (checked) choice: DEFAULT -> ``default_alpha``
    (None for a scheme SmoothQuant does not apply to); OFF / None -> no smoothing (None); an
    alpha or AUTO as given, whatever the scheme (asked for, a dynamic or weight-only scheme is
    smoothed too: the smoothing then only reshapes its weights' quantization error)."""
    choice = check_choice(choice)
    if choice == DEFAULT:
        return default_alpha(scheme)
    return choice


def scheme_alphas(choice: float | str | None, schemes) -> dict[Scheme, float | str | None]:
    """Each of ``schemes``' alpha under one choice (``resolve_alpha``): the one rule of
    ``lowbit.quantize``, ``lowbit quantize`` and ``lowbit compare``, for one scheme as for every
    group of a recipe (each group gets what its scheme would get alone). ValueError for a bad
    choice."""
    return {s: resolve_alpha(choice, s) for s in schemes}
