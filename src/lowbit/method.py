"""How a run quantizes, decided once for every path: ``resolve_method`` turns the ``scheme``
argument and the calibration arguments into a ``Method`` (the recipe: one scheme is its uniform
case; each scheme's SmoothQuant alpha; the CalibrationConfig; the calibration data as given).

``lowbit.quantize`` (in memory, ``lowbit.model_quant.InMemoryPlan``), ``lowbit.quantize_checkpoint``
and ``lowbit quantize`` (``lowbit.streamed.CheckpointPlan``) and ``lowbit compare`` build their
plan around the one Method this step gives; the paths resolve its recipe on the linears they
find (``Method.assignment``) and ask it whether the run calibrates (``Method.calibrates``, the
one rule ``calibrates``) and what is refused without calibration data. Nothing here imports
torch at import time (the CLI builds its plan before torch is loaded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from lowbit.algorithms.smoothquant.defaults import DEFAULT
from lowbit.errors import OptionRef, QuantizationError


@dataclass(frozen=True)
class CalibrationChoice:
    """How the run calibrates, as given: the data (``calibration=``), its tokenizer (None: the
    source folder's), the SmoothQuant choice, and a CalibrationConfig, or a preset name and/or
    its fields (``lowbit.calibration.config.calibration_config``)."""

    data: object = None
    tokenizer: object = None
    smoothquant: object = DEFAULT
    config: object = None
    preset: str | None = None
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TargetChoice:
    """Which weights are quantized: linears kept in float (exact names or regexes), the output
    head, and whether targets lowbit cannot quantize stay in float (listed) instead of an error."""

    ignore: tuple[str, ...] = ()
    include_lm_head: bool = False
    allow_unquantized: bool = False


def calibrates(scheme, smoothquant, cfg) -> bool:
    """Whether quantizing ``scheme`` runs calibration: static activation scales, SmoothQuant (an
    alpha resolved by ``scheme_alphas``, or "auto"), GPTQ weights (``cfg.rounding_for``) or block
    reconstruction (``cfg.reconstruct_iters_for``). The one rule every path follows."""
    from lowbit.algorithms.gptq import WeightRounding

    return scheme.needs_calibration or smoothquant is not None or cfg.rounding_for(scheme) is WeightRounding.GPTQ \
        or cfg.reconstruct_iters_for(scheme) > 0


@dataclass(frozen=True)
class Method:
    """How a run quantizes (see the module docstring). ``recipe``: a ``lowbit.recipes.Recipe``;
    ``alphas``: every scheme of the recipe -> its SmoothQuant alpha (``scheme_alphas``);
    ``config``: the CalibrationConfig; ``calibration``: the arguments it was resolved from."""

    recipe: object
    alphas: dict
    config: object
    calibration: CalibrationChoice = CalibrationChoice()

    @property
    def schemes(self) -> list:
        """Every scheme the recipe names (a default no linear falls to included)."""
        return list(self.recipe.schemes)

    @property
    def has_data(self) -> bool:
        return self.calibration.data is not None

    def alphas_of(self, schemes: Iterable) -> dict:
        """The alphas of ``schemes`` (the ones linears got), in their order."""
        return {s: self.alphas[s] for s in schemes}

    def calibrates(self, schemes: Iterable) -> bool:
        """Whether quantizing linears of ``schemes`` calibrates (``calibrates``), given data."""
        return any(calibrates(s, self.alphas[s], self.config) for s in schemes)

    def assignment(self, names: Iterable[str]):
        """The recipe on ``names``, the quantizable linears a path found (``lowbit.recipes.plan``)."""
        from lowbit.recipes.plan import plan

        return plan(self.recipe, names)

    def smoothquant(self, assign):
        """What the calibrator takes for ``assign``: the alpha of its one scheme, or scheme -> alpha."""
        if assign.uniform is not None:
            return self.alphas[assign.uniform]
        return self.alphas_of(assign.distinct)

    def check_without_data(self, schemes: list, kv_cache: str | None) -> None:
        """In memory without calibration data: QuantizationError when one of ``schemes`` has static
        activation scales, SmoothQuant or GPTQ is asked for, or a KV cache is."""
        from lowbit.algorithms.gptq import WeightRounding

        for s in schemes:
            if s.needs_calibration:
                raise QuantizationError(f"scheme {s.name} has static activation scales and needs calibration data "
                                        f"(pass calibration=...)")
        if any(a is not None for a in self.alphas_of(schemes).values()):
            raise QuantizationError("smoothquant needs calibration data (pass calibration=...)")
        if self.config.weight_rounding is WeightRounding.GPTQ:
            raise QuantizationError(f"weight_rounding={self.config.weight_rounding.value!r} needs calibration data "
                                    f"(pass calibration=...)")
        if kv_cache is not None:
            raise QuantizationError(f"kv_cache={kv_cache!r} needs calibration data (pass calibration=...)")

    def check_model_free(self) -> None:
        """A checkpoint run without calibration data is model-free, which refuses the schemes that
        need calibration itself (naming the dynamic alternatives); SmoothQuant or GPTQ asked for
        on schemes that need none is a QuantizationError here (without data the 4-bit schemes'
        default GPTQ is plain RTN)."""
        from lowbit.algorithms.gptq import WeightRounding

        if self.has_data or any(s.needs_calibration for s in self.schemes):
            return
        if any(a is not None for a in self.alphas.values()) or self.config.weight_rounding is WeightRounding.GPTQ:
            raise QuantizationError(f"{self.recipe.label} with SmoothQuant or GPTQ needs calibration data (pass "
                                    f"{{calibration}})", calibration=OptionRef("calibration", "builtin"))


def resolve_method(scheme, calibration: CalibrationChoice = CalibrationChoice()) -> Method:
    """The Method of ``scheme`` (a preset name, Scheme, or anything ``Recipe.of`` takes) under
    ``calibration``: SchemeError / RecipeError for the scheme, QuantizationError for a bad
    SmoothQuant choice or calibration options (``calibration_config``), before any work."""
    from lowbit.algorithms.smoothquant.defaults import scheme_alphas
    from lowbit.calibration.config import calibration_config
    from lowbit.recipes.plan import recipe_of

    recipe = recipe_of(scheme)  # an unknown preset: SchemeError; a malformed recipe: RecipeError
    try:
        alphas = scheme_alphas(calibration.smoothquant, recipe.schemes)
    except ValueError as e:
        raise QuantizationError(str(e)) from None
    cfg = calibration_config(calibration.config, calibration.preset, calibration.options)
    return Method(recipe, alphas, cfg, calibration)
