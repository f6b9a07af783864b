"""GgmlLinear: a linear layer holding a GGUF tensor's GGML blocks as they are in the file.

    lin = GgmlLinear(data, GgmlType.Q4_K, name="model.layers.0.mlp.down_proj")
    y = lin(x)                       # x @ decode(data).T (+ bias), float32
    lin.dot_input = DotInput.Q8_K    # llama.cpp's CPU arithmetic: x rounded as its dot products see it

``data`` is uint8 [out, row bytes]: row r is output channel r's blocks (the GGUF tensor's rows in
the model's row order). Nothing float is kept: every forward decodes the weight with lowbit's one
GGML decoder (``lowbit.numerics.ggml.decode``, bit-identical to gguf-py's and llama.cpp's
dequantization) and drops it after the matmul, so the layer costs its bytes in memory and one
decode per forward in time.

``dot_input`` None (the default) computes what the file means, ``x @ W.T`` in float32 with the
decoded W (the same values as transformers' dequantized weight, bit for bit: logits equal those of
the float model holding the decoded weights). Set to a ``DotInput`` (``lowbit.numerics.ggml_act``)
it reproduces llama.cpp's CPU backend: the activations rounded to the weight's ``vec_dot_type``
first, and for Q4_1 / Q5_1 weights (Q8_1 activations) each block's min term taken with the stored
fp16 block sum ``s`` as llama.cpp's dot product does; equal to llama.cpp up to float summation order.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lowbit.errors import FormatError
from lowbit.numerics.ggml import GEOMETRY, GgmlType, decode
from lowbit.numerics.ggml_act import BLOCK, VEC_DOT, DotInput, dot_input_values
from lowbit.numerics.ggml_codes import grid_of

#: GGML types whose blocks add a min (offset) term taken with Q8_1's stored sums
_Q8_1_MIN_TYPES = (GgmlType.Q4_1, GgmlType.Q5_1)


class GgmlLinear(nn.Module):
    """y = x decode(W)^T + b, W held as GGML ``kind`` blocks (buffer ``weight_data``, uint8 [out, row bytes])."""

    def __init__(self, data: torch.Tensor, kind: GgmlType, bias: torch.Tensor | None = None, *, name: str = "",
                 dot_input: DotInput | None = None) -> None:
        super().__init__()
        kind = GgmlType(kind)
        n, nb = GEOMETRY[kind]
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % nb:
            raise FormatError(f"tensor {name!r}: {kind.value} rows must be uint8 [out, whole blocks of {nb} bytes], "
                              f"got {data.dtype} {list(data.shape)}")
        self.kind = kind
        self.name = name
        self.out_features = data.shape[0]
        self.in_features = data.shape[1] // nb * n
        self.register_buffer("weight_data", data.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32), requires_grad=False)
        self.dot_input = dot_input

    @property
    def llama_dot_input(self) -> DotInput:
        """The type llama.cpp's CPU backend rounds this layer's activations to."""
        return VEC_DOT[self.kind]

    @property
    def quantizes_inputs(self) -> bool:
        """Whether the forward rounds its input to an 8-bit type (a step function of x: its
        perplexity has a float-rounding spread, lowbit.eval.spread)."""
        return self.dot_input in BLOCK  # Q8_0, Q8_1, Q8_K

    def decoded_weight(self) -> torch.Tensor:
        """float32 [out, in]: the weight as llama.cpp dequantizes it (made anew on every call)."""
        return decode(self.weight_data, self.kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.decoded_weight()
        x32 = x.to(torch.float32)
        if self.dot_input is None:
            y = torch.nn.functional.linear(x32, w, self.bias)
        else:
            xv, s = dot_input_values(x32, self.dot_input)
            y = torch.nn.functional.linear(xv, w)
            if s is not None and self.kind in _Q8_1_MIN_TYPES:
                # llama.cpp takes a block's min term as m * s, s = fp16(d * sum q) stored with the
                # activations, where x_values @ W.T takes m * fp16(d) * sum q: add the difference
                sums = xv.reshape(*xv.shape[:-1], -1, 32).sum(dim=-1)      # fp16(d) * sum q, exact
                m = -grid_of(self.weight_data, self.kind).offset           # [out, in / 32]
                y = y + torch.nn.functional.linear(s - sums, m)
            if self.bias is not None:
                y = y + self.bias
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        how = "float32" if self.dot_input is None else f"inputs as {self.dot_input.value} (llama.cpp CPU)"
        return f"in={self.in_features}, out={self.out_features}, ggml={self.kind.value}, {how}"
