"""Typed description of how a tensor is quantized, and of a scheme (weights + input activations).

A scheme is data: every behaviour of the quantizer, the modules, the file writers and the
backends follows from these fields, and ``to_dict`` writes every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from lowbit.errors import SchemeError
from lowbit.numerics import FormatName, IntFormat, get_format


class Granularity(str, Enum):
    """Which elements share one scale. All group-like kinds run along the last (input) dim; BLOCK
    also spans group_size rows (its scales are held per row, equal across the rows of a tile)."""

    TENSOR = "tensor"    # one scale for the whole tensor
    CHANNEL = "channel"  # one scale per output row of a weight [out, in]
    TOKEN = "token"      # one scale per row of an activation [..., in]
    GROUP = "group"      # one scale per group_size consecutive elements of the last dim
    BLOCK = "block"      # one scale per group_size x group_size tile of a weight [out, in] (FP8 block)

    def __str__(self) -> str:
        return self.value


class Dynamic(str, Enum):
    """When activation scales are chosen. Weights are always STATIC."""

    STATIC = "static"    # from calibration, stored in the checkpoint
    DYNAMIC = "dynamic"  # from each input at run time
    LOCAL = "local"      # block scales at run time, the global scale static (NVFP4 inputs)

    def __str__(self) -> str:
        return self.value


class WeightObserver(str, Enum):
    """How a weight spec chooses each scale group's scale from the group's values (the spec's
    ``observer``; activations' static scales are chosen by ``CalibrationConfig.observer``, a
    ``lowbit.calibration.ActivationObserver``).

    MAX: the extreme values (symmetric: amax; asymmetric: min and max) give the scale.
    MSE: the scale with the smallest squared quantize-dequantize error (lowbit.quant.mse_scales).
    FULL_RANGE: symmetric INT weights only: the group's signed extreme maps to the most
        negative code, scale = extreme / qmin (negative when the extreme is positive), so all
        2^bits codes are used (INT4: step amax/8 instead of amax/7; auto-round's symmetric
        INT4 rule).
    FULL_RANGE_MSE: the same formats: FULL_RANGE's scale times r, for the r in 1.00, 0.98, ... 0.70
        with the smallest squared quantize-dequantize error of the group (lowbit.quant.mse_scales;
        r = 1 kept on ties): the signed extreme may clip at qmin for a finer step elsewhere.
    HALF_STEP: symmetric INT weights only: scale = amax / ((qmax - qmin) / 2) = amax / (qmax + 1/2)
        (INT8: amax / 127.5; the symmetric rule of compressed-tensors and torchao). -amax lands
        on qmin exactly and +amax is clipped to qmax by half a step, so the worst-case error
        stays half a step while the step shrinks by qmax / (qmax + 1/2).
    """

    MAX = "max"
    MSE = "mse"
    FULL_RANGE = "full-range"
    FULL_RANGE_MSE = "full-range-mse"
    HALF_STEP = "half-step"

    def __str__(self) -> str:
        return self.value

    @property
    def rule(self) -> "WeightObserver":
        """The closed-form rule whose scale starts the group's scale: MSE searches around MAX,
        FULL_RANGE_MSE around FULL_RANGE; every other observer is its own rule."""
        return {WeightObserver.MSE: WeightObserver.MAX,
                WeightObserver.FULL_RANGE_MSE: WeightObserver.FULL_RANGE}.get(self, self)

    @property
    def searches(self) -> bool:
        """Whether the rule's scale is then searched for the smallest squared error
        (lowbit.quant.mse_scales)."""
        return self.rule is not self


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor is quantized.

    format: element format (INTn, E2M1, E4M3...).
    granularity, group_size: which elements share a scale (group_size only for GROUP).
    symmetric: False adds an integer zero point (INT formats only).
    dynamic: for activations, when scales are computed (weights: STATIC).
    scale_format: how the scale itself is stored and rounded: FP32 (plain), UE4M3 / UE5M3
        (block scale rounded to that format), E8M0 (power of two, OCP MX rule).
    global_scale: a per-tensor FP32 second-level scale (NVFP4), stored as the divisor
        ``scale_max * elem_max / amax``; block scales are computed after multiplying by it.
    observer: how scales computed from the tensor itself are chosen (weights): MAX, the
        extreme-value rule, or MSE, a per-group search for the smallest squared error
        (lowbit.quant.mse_scales), or FULL_RANGE (symmetric fp32-scaled INT only: scale = signed
        extreme / qmin), FULL_RANGE_MSE (the same formats: FULL_RANGE's scale searched down by
        the MSE rule) or HALF_STEP (the same formats: scale = amax / (qmax + 1/2); see
        WeightObserver). The NVFP4 global scale stays amax-based. Dynamic specs and the
        input activations of a scheme keep MAX (static activation scales are chosen by
        ``CalibrationConfig.observer``).
    scale_floor: None, or the smallest scale computed from data (symmetric fp32 scales under
        the ``max`` rule): scale = max(amax / elem_max, scale_floor). auto-round's loader floors
        its dynamic FP8 activation scales at 1 / (448 * 512); None (every lowbit preset): no
        floor, and an all-zero group gets a zero scale.
    """

    format: FormatName
    granularity: Granularity
    group_size: int | None = None
    symmetric: bool = True
    dynamic: Dynamic = Dynamic.STATIC
    scale_format: FormatName = FormatName.FP32
    global_scale: bool = False
    observer: WeightObserver = WeightObserver.MAX
    scale_floor: float | None = None

    def __post_init__(self) -> None:
        # normalise strings given by callers into the enums
        object.__setattr__(self, "format", FormatName(self.format))
        object.__setattr__(self, "granularity", Granularity(self.granularity))
        object.__setattr__(self, "dynamic", Dynamic(self.dynamic))
        object.__setattr__(self, "scale_format", FormatName(self.scale_format))
        try:
            object.__setattr__(self, "observer", WeightObserver(self.observer))
        except ValueError:
            raise SchemeError(f"unknown weight observer {self.observer!r}; a spec takes "
                              f"{' or '.join(repr(k.value) for k in WeightObserver)} (a calibration observer of "
                              f"activations belongs in CalibrationConfig.observer)") from None
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        if self.format in (FormatName.FP32, FormatName.E8M0, FormatName.UE4M3, FormatName.UE5M3):
            raise SchemeError(f"{self.format} is a scale format, not an element format")
        if self.granularity in (Granularity.GROUP, Granularity.BLOCK):
            if not self.group_size or self.group_size < 1:
                raise SchemeError(f"{self.granularity.value} granularity needs a positive group_size")
        elif self.group_size is not None:
            raise SchemeError(f"group_size is only meaningful for group granularity, not {self.granularity}")
        if self.granularity is Granularity.BLOCK and not (
                self.dynamic is Dynamic.STATIC and self.symmetric and self.scale_format is FormatName.FP32
                and self.observer is WeightObserver.MAX):
            raise SchemeError("block granularity (square tiles of a weight) is static, symmetric, with fp32 scales "
                              "and the max observer")
        if self.scale_format is not FormatName.FP32 and self.granularity is not Granularity.GROUP:
            raise SchemeError(f"scale format {self.scale_format} needs group granularity")
        if self.scale_format not in (FormatName.FP32, FormatName.UE4M3, FormatName.UE5M3, FormatName.E8M0):
            raise SchemeError(f"unsupported scale format {self.scale_format}")
        if self.global_scale and self.scale_format in (FormatName.FP32, FormatName.E8M0):
            raise SchemeError("a global scale only goes with UE4M3/UE5M3 block scales")
        if not self.symmetric and not self.is_integer:
            raise SchemeError("asymmetric quantization is only defined for INT formats")
        if not self.symmetric and self.scale_format is not FormatName.FP32:
            raise SchemeError(f"asymmetric quantization needs fp32 scales, not {self.scale_format} block scales")
        if self.dynamic is Dynamic.LOCAL and not self.global_scale:
            raise SchemeError("dynamic 'local' means dynamic block scales under a static global scale")
        if self.dynamic is Dynamic.STATIC and self.granularity is Granularity.TOKEN:
            raise SchemeError("per-token scales are necessarily dynamic")
        if self.observer.rule in (WeightObserver.FULL_RANGE, WeightObserver.HALF_STEP) and not (
                self.is_integer and self.symmetric and self.scale_format is FormatName.FP32):
            raise SchemeError(f"observer {self.observer.value!r} is a rule for symmetric INT formats with fp32 scales, "
                              f"not {self.format.value} / {self.scale_format.value} scales"
                              f"{'' if self.symmetric else ' (asymmetric)'}")
        if self.scale_floor is not None:
            f = self.scale_floor
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < float("inf"):
                raise SchemeError(f"scale_floor must be a positive number or None, got {f!r}")
            if self.scale_format is not FormatName.FP32 or not self.symmetric or self.observer is not WeightObserver.MAX:
                raise SchemeError("scale_floor applies to symmetric fp32 scales under the 'max' rule, not "
                                  f"{self.format.value} / {self.scale_format.value} scales, observer {self.observer.value}"
                                  f"{'' if self.symmetric else ' (asymmetric)'}")
            object.__setattr__(self, "scale_floor", float(f))
        if self.dynamic is not Dynamic.STATIC and self.observer is not WeightObserver.MAX:
            raise SchemeError(f"observer {self.observer.value!r} needs static scales: {self.dynamic.value} "
                              f"scales are computed at run time with the 'max' rule")

    # ------------------------------------------------------------------ derived facts
    @property
    def is_integer(self) -> bool:
        return isinstance(get_format(self.format), IntFormat)

    @property
    def bits(self) -> int:
        return get_format(self.format).bits

    @property
    def is_microscaled(self) -> bool:
        """Block scales rounded to a low-bit format (NVFP4, NVFP4-E5M3, MX)."""
        return self.scale_format is not FormatName.FP32

    @property
    def needs_calibration(self) -> bool:
        """Static per-tensor scales (or the static NVFP4 global scale) come from calibration."""
        return self.dynamic in (Dynamic.STATIC, Dynamic.LOCAL)

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format.value,
            "granularity": self.granularity.value,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "dynamic": self.dynamic.value,
            "scale_format": self.scale_format.value,
            "global_scale": self.global_scale,
            "observer": self.observer.value,
            "scale_floor": self.scale_floor,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantSpec":
        """The spec ``to_dict`` wrote; ``scale_floor`` may be absent (files written before the
        field existed: no floor), every other field is required."""
        if not isinstance(d, dict):
            raise SchemeError(f"a quantization spec must be a mapping, got {d!r}")
        expected = {"format", "granularity", "group_size", "symmetric", "dynamic", "scale_format", "global_scale",
                    "observer", "scale_floor"}
        missing, unknown = expected - set(d) - {"scale_floor"}, set(d) - expected
        if missing or unknown:
            raise SchemeError(
                f"quantization spec fields: missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        for key in ("symmetric", "global_scale"):
            if not isinstance(d[key], bool):
                raise SchemeError(f"quantization spec field {key!r} must be true or false, got {d[key]!r}")
        gs = d["group_size"]
        if gs is not None and (isinstance(gs, bool) or not isinstance(gs, int)):
            raise SchemeError(f"quantization spec field 'group_size' must be an integer or null, got {gs!r}")
        try:
            return cls(**d)
        except ValueError as e:  # bad enum value
            raise SchemeError(f"invalid quantization spec {d}: {e}") from e

    def describe(self) -> str:
        parts = [self.format.value]
        if self.granularity is Granularity.GROUP:
            parts.append(f"group {self.group_size}")
        elif self.granularity is Granularity.BLOCK:
            parts.append(f"block {self.group_size}x{self.group_size}")
        else:
            parts.append(f"per {self.granularity.value}")
        if self.scale_format is not FormatName.FP32:
            parts.append(f"{self.scale_format.value} scales")
        if self.global_scale:
            parts.append("+ fp32 global")
        if not self.symmetric:
            parts.append("asymmetric")
        if self.observer is not WeightObserver.MAX:
            parts.append(f"{self.observer.value} observer")
        if self.scale_floor is not None:
            parts.append(f"scales >= {self.scale_floor:.6g}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Scheme:
    """A named quantization scheme: weight spec and input-activation spec (None: weight-only)."""

    name: str
    weights: QuantSpec
    input_activations: QuantSpec | None = None

    def __post_init__(self) -> None:
        if self.weights.dynamic is not Dynamic.STATIC:
            raise SchemeError(f"scheme {self.name}: weights are quantized statically")
        a = self.input_activations
        if a is not None and a.observer is not WeightObserver.MAX:
            raise SchemeError(f"scheme {self.name}: input activations keep observer 'max' (static activation "
                              f"scales are chosen by the calibration observer, CalibrationConfig.observer), "
                              f"got {a.observer.value!r}")

    @property
    def needs_calibration(self) -> bool:
        a = self.input_activations
        return a is not None and a.needs_calibration

    @property
    def weight_only(self) -> bool:
        return self.input_activations is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "weights": self.weights.to_dict(),
            "input_activations": None if self.input_activations is None else self.input_activations.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Scheme":
        expected = {"name", "weights", "input_activations"}
        if not isinstance(d, dict):
            raise SchemeError(f"a scheme must be a mapping, got {d!r}")
        if set(d) != expected:
            raise SchemeError(f"scheme fields must be {sorted(expected)}, got {sorted(d)}")
        acts = d["input_activations"]
        return cls(
            name=str(d["name"]),
            weights=QuantSpec.from_dict(d["weights"]),
            input_activations=None if acts is None else QuantSpec.from_dict(acts),
        )
