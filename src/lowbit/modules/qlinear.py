"""QuantLinear: one quantized linear module for every scheme.

It holds real low-bit weights (uint8 codes, unpacked, plus scales) and the input-activation
spec with its static scales, and delegates the computation to a backend from
``lowbit.backends``. Built from a float ``nn.Linear`` or from tensors read from disk.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lowbit.errors import QuantizationError
from lowbit.quant import QuantizedTensor, dequantize, quantize
from lowbit.schemes import Dynamic, Scheme


class QuantLinear(nn.Module):
    """y = x W^T + b with W quantized under ``scheme.weights`` and x under ``scheme.input_activations``.

    Buffers (all persistent, all needed to reproduce the numerics exactly):
      weight_codes [out, in] uint8, weight_scale float32, weight_zero_point int8 (asymmetric),
      weight_global_scale float32 [1] (NVFP4), input_scale float32 [1] (static activations),
      input_global_scale float32 [1] (NVFP4 activations).
    """

    def __init__(self, in_features: int, out_features: int, scheme: Scheme, bias: bool = False,
                 name: str = "", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.scheme = scheme
        self.name = name
        self.dtype = dtype  # the float dtype of the model around it (outputs are cast to it)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.register_buffer("weight_codes", torch.zeros(out_features, in_features, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(1))
        self.weight_zero_point: torch.Tensor | None
        self.weight_global_scale: torch.Tensor | None
        self.input_scale: torch.Tensor | None
        self.input_global_scale: torch.Tensor | None
        self.register_buffer("weight_zero_point", None)
        self.register_buffer("weight_global_scale", None)
        self.register_buffer("input_scale", None)
        self.register_buffer("input_global_scale", None)
        self.backend = None  # set by lowbit.backends.use_backend (lowbit.quantize and lowbit.load call it)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_quantized(cls, qweight: QuantizedTensor, scheme: Scheme, bias: torch.Tensor | None = None, *,
                       input_scale: torch.Tensor | None = None, input_global_scale: torch.Tensor | None = None,
                       name: str = "", dtype: torch.dtype = torch.float32) -> "QuantLinear":
        if qweight.spec != scheme.weights:
            raise QuantizationError(f"layer {name!r}: weight spec does not match scheme {scheme.name}")
        out_f, in_f = qweight.codes.shape
        m = cls(in_f, out_f, scheme, bias is not None, name=name, dtype=dtype)
        m.weight_codes = qweight.codes
        m.weight_scale = qweight.scale
        m.weight_zero_point = qweight.zero_point
        m.weight_global_scale = qweight.global_scale
        if bias is not None:
            m.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        m.set_input_scales(input_scale=input_scale, input_global_scale=input_global_scale)
        return m

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: Scheme, *, name: str = "",
                    weight_global_scale: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                    input_global_scale: torch.Tensor | None = None) -> "QuantLinear":
        """Round-to-nearest quantization of ``linear.weight`` (global scale shared when given)."""
        qw = quantize(linear.weight.detach(), scheme.weights, global_scale=weight_global_scale,
                      name=f"{name}.weight" if name else "weight")
        return cls.from_quantized(qw, scheme, linear.bias, input_scale=input_scale,
                                  input_global_scale=input_global_scale, name=name, dtype=linear.weight.dtype)

    def set_input_scales(self, input_scale: torch.Tensor | None = None,
                         input_global_scale: torch.Tensor | None = None) -> None:
        a = self.scheme.input_activations
        if input_scale is not None:
            if a is None or a.dynamic is not Dynamic.STATIC:
                raise QuantizationError(f"layer {self.name!r}: scheme {self.scheme.name} has no static input scale")
            self.input_scale = input_scale.detach().to(torch.float32).reshape(1)
        if input_global_scale is not None:
            if a is None or not a.global_scale:
                raise QuantizationError(f"layer {self.name!r}: scheme {self.scheme.name} has no input global scale")
            self.input_global_scale = input_global_scale.detach().to(torch.float32).reshape(1)

    # ------------------------------------------------------------------ views
    def weight_qtensor(self) -> QuantizedTensor:
        return QuantizedTensor(self.weight_codes, self.weight_scale, self.scheme.weights,
                               self.weight_zero_point, self.weight_global_scale)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight's values [out, in] in ``dtype``, contiguous (a ragged last group is stored
        padded; F.linear on the padded view is slower and every backend must see one layout)."""
        return dequantize(self.weight_qtensor(), dtype).contiguous()

    @property
    def weight(self) -> torch.Tensor:
        """What a model's own forward reads as ``linear.weight`` (ERGO's layers read
        ``o_proj.weight.dtype``): the dequantized weight in the model's dtype, computed at each
        access and never stored. lowbit's own code reads ``weight_qtensor`` / ``dequantized_weight``."""
        return self.dequantized_weight(self.dtype)

    def check_ready(self) -> None:
        """Static activation scales must be present before running."""
        a = self.scheme.input_activations
        if a is None:
            return
        if a.dynamic is Dynamic.STATIC and self.input_scale is None:
            raise QuantizationError(
                f"layer {self.name!r}: scheme {self.scheme.name} needs a calibrated static input scale"
            )
        if a.global_scale and self.input_global_scale is None:
            raise QuantizationError(
                f"layer {self.name!r}: scheme {self.scheme.name} needs a calibrated input global scale"
            )

    # ------------------------------------------------------------------ run
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend is None:
            raise QuantizationError(f"layer {self.name!r} has no backend: lowbit.quantize and lowbit.load set one; "
                                    f"after building layers by hand call lowbit.use_backend(model)")
        return self.backend.forward(self, x)

    def extra_repr(self) -> str:
        b = getattr(self.backend, "name", "auto")
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme.name}, backend={b}"
