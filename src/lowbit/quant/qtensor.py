"""QuantizedTensor: codes plus the scales needed to decode them, as plain tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowbit.numerics import FormatName, get_format
from lowbit.kernels.bitpack import pack_nibbles, unpack_nibbles
from lowbit.schemes import QuantSpec


@dataclass
class QuantizedTensor:
    """A quantized tensor in unpacked form.

    codes: uint8, the same shape as the original tensor, one element code each
        (INTn: n-bit two's complement in the low bits; float formats: their bit layout).
    scale: float32. TENSOR: shape [1]; CHANNEL/TOKEN: [*lead, 1]; GROUP: [*lead, n_groups].
        For microscaled specs these are the block scales as values of ``spec.scale_format``
        (exactly representable), before division by the global scale.
    zero_point: int8 with the shape of ``scale`` (asymmetric INT only), else None.
    global_scale: float32 [1], the NVFP4 divisor (``spec.global_scale``), else None.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    spec: QuantSpec
    zero_point: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    # the codes of ``scale`` when the quantizer had them at hand (derived data: never compared)
    known_scale_codes: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def scale_codes(self) -> torch.Tensor:
        """Block scales as uint8 codes of ``spec.scale_format`` (microscaled specs only)."""
        if self.spec.scale_format is FormatName.FP32:
            raise ValueError("fp32 scales have no codes")
        if self.known_scale_codes is not None:
            return self.known_scale_codes
        from lowbit.kernels import codes

        return codes.encode(get_format(self.spec.scale_format), self.scale)

    def values(self) -> torch.Tensor:
        """The decoded element values (no scaling), float32."""
        return get_format(self.spec.format).decode(self.codes)

    def to(self, device: torch.device | str) -> "QuantizedTensor":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedTensor(self.codes.to(device), self.scale.to(device), self.spec,
                               mv(self.zero_point), mv(self.global_scale), mv(self.known_scale_codes))

    def equal(self, other: "QuantizedTensor") -> bool:
        """Bit-identical codes, scales, zero points and global scale, same spec."""
        def same(a, b):
            if a is None or b is None:
                return a is None and b is None
            return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
        return (self.spec == other.spec and same(self.codes, other.codes) and same(self.scale, other.scale)
                and same(self.zero_point, other.zero_point) and same(self.global_scale, other.global_scale))


class PackedQuantizedTensor(QuantizedTensor):
    """A QuantizedTensor whose 4-bit codes are held nibble-packed (``packed`` [..., n / 2], element
    2i in the low nibble), as the lowbit and compressed-tensors layouts store them: produced by
    the native model-free path, which encodes and packs in one pass. ``codes`` unpacks on access
    (any consumer still works); ``nibbles`` hands the packed bytes to a layout as they are."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, spec: QuantSpec,
                 zero_point: torch.Tensor | None = None, global_scale: torch.Tensor | None = None,
                 known_scale_codes: torch.Tensor | None = None) -> None:
        self.packed = packed
        self.scale = scale
        self.spec = spec
        self.zero_point = zero_point
        self.global_scale = global_scale
        self.known_scale_codes = known_scale_codes

    @property  # type: ignore[override]
    def codes(self) -> torch.Tensor:
        return unpack_nibbles(self.packed)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], 2 * self.packed.shape[-1]))


def nibbles(qt: QuantizedTensor, name: str = "tensor") -> torch.Tensor:
    """The nibble-packed codes of ``qt``: its packed bytes when it holds them, else packed now."""
    if isinstance(qt, PackedQuantizedTensor):
        return qt.packed
    return pack_nibbles(qt.codes, name)
