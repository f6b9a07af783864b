"""GGML's weight types, one entry point: ``GgmlType``, its block geometry, ``encode`` and ``decode``.

    from lowbit.numerics.ggml import GgmlType, encode, decode
    data = encode(w, GgmlType.Q4_K)          # uint8 [out, in / 256 * 144], llama.cpp's reference bytes
    back = decode(data, GgmlType.Q4_K)       # float32 [out, in], as llama.cpp dequantizes

Each type has one definition in the module that implements it (``ggml_blocks``: Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1; ``ggml_kquants`` / ``ggml_kquant_search``: Q2_K ... Q6_K; ``ggml_fp4``: MXFP4,
NVFP4); this module only dispatches on the typed value. Encoding is llama.cpp's reference
quantizer without importance weights, byte for byte (tests/numerics, bench/gguf/RESULTS-gguf.md).
"""

from __future__ import annotations

import enum

import torch

from lowbit.errors import QuantizationError


class GgmlType(str, enum.Enum):
    """GGML tensor types lowbit encodes or decodes (values: gguf-py's names, lower case)."""

    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    Q5_0 = "q5_0"
    Q5_1 = "q5_1"
    Q2_K = "q2_k"
    Q3_K = "q3_k"
    Q4_K = "q4_k"
    Q5_K = "q5_k"
    Q6_K = "q6_k"
    MXFP4 = "mxfp4"
    NVFP4 = "nvfp4"


class ImportanceSearch(str, enum.Enum):
    """How an importance matrix chooses each block's scale (``encode``'s ``search``)."""

    LLAMA_CPP = "llama-cpp"  # llama-quantize --imatrix's search, its bytes
    DIRECT = "direct"        # the importance alone weighs the squared error, over a wider grid (ggml_direct)


#: the types whose search ``ImportanceSearch.DIRECT`` changes (the others: llama.cpp's search)
DIRECT_TYPES = frozenset({GgmlType.Q4_0, GgmlType.Q5_0})

#: (weights per block, bytes per block)
GEOMETRY = {GgmlType.Q8_0: (32, 34), GgmlType.Q4_0: (32, 18), GgmlType.Q4_1: (32, 20), GgmlType.Q5_0: (32, 22),
            GgmlType.Q5_1: (32, 24), GgmlType.Q2_K: (256, 84), GgmlType.Q3_K: (256, 110),
            GgmlType.Q4_K: (256, 144), GgmlType.Q5_K: (256, 176), GgmlType.Q6_K: (256, 210),
            GgmlType.MXFP4: (32, 17), GgmlType.NVFP4: (64, 36)}


def fp16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [N] -> its fp16 (round to nearest even) as 2 little-endian bytes [N, 2]: GGML's scales."""
    return v.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def fp16_value(b: torch.Tensor) -> torch.Tensor:
    """2 little-endian bytes [N, 2] -> float32 [N] of the fp16 they hold."""
    return b.contiguous().view(torch.float16).reshape(-1).to(torch.float32)


def weights_in_rows(x: torch.Tensor, block: int, name: str, what: str = "block") -> torch.Tensor:
    """``x`` [..., K] as float32 rows of ``block`` weights [K / block * ..., block]; a QuantizationError
    naming the tensor if K is not a multiple of ``block`` or a weight is NaN or infinite."""
    x = x.detach().to(torch.float32)
    if x.shape[-1] % block:
        raise QuantizationError(f"tensor {name!r}: last dimension {x.shape[-1]} is not a multiple of GGML's "
                                f"{what} of {block}")
    if not bool(torch.isfinite(x).all()):
        raise QuantizationError(f"tensor {name!r} holds NaN or infinite values")
    return x.reshape(-1, block)


def bytes_in_blocks(data: torch.Tensor, kind: GgmlType) -> torch.Tensor:
    """uint8 ``data`` [..., n * B] of ``kind`` as blocks [n * ..., B]; a QuantizationError otherwise."""
    nb = GEOMETRY[kind][1]
    if data.dtype != torch.uint8 or data.shape[-1] % nb:
        raise QuantizationError(f"{kind.value} data must be uint8 in whole blocks of {nb} bytes, got "
                                f"{data.dtype} [..., {data.shape[-1]}]")
    return data.reshape(-1, nb)


def bits_per_weight(kind: GgmlType) -> float:
    """Stored bits per weight, scales included (Q4_K: 4.5)."""
    n, b = GEOMETRY[GgmlType(kind)]
    return 8 * b / n


def encode(x: torch.Tensor, kind: GgmlType, name: str = "tensor", importance: torch.Tensor | None = None,
           search: ImportanceSearch = ImportanceSearch.LLAMA_CPP, direct_search=None) -> torch.Tensor:
    """``x`` [..., K] as GGML ``kind`` blocks, uint8 [..., K / n * B] (llama.cpp's reference bytes);
    with ``importance`` [K] (one weight per input column: an importance matrix), llama.cpp's
    weighted encoding (``quantize_<type>`` given quant_weights; MXFP4 and Q8_0 ignore them there),
    or with ``search`` DIRECT, lowbit's search for the ``DIRECT_TYPES`` (``ggml_direct``; the
    stored layout is the type's either way). ``direct_search``: an implementation of
    ``ggml_direct.direct_symmetric_search`` with its contract and bits (None: that function;
    lowbit.kernels.ggml.encode passes its entry point, which may run C)."""
    from lowbit.numerics import ggml_blocks, ggml_fp4, ggml_kquant_search as ks

    kind = GgmlType(kind)
    if importance is not None and ImportanceSearch(search) is ImportanceSearch.DIRECT and kind in DIRECT_TYPES:
        from lowbit.numerics.ggml_direct import encode_blocks_direct

        return encode_blocks_direct(x, kind, importance, name, direct_search)
    if kind in ggml_blocks.BLOCK_BYTES:
        if importance is not None:
            from lowbit.numerics.ggml_kquant_imatrix import encode_blocks_weighted

            return encode_blocks_weighted(x, kind, importance, name)
        return ggml_blocks.encode(x, kind, name)
    encoders = {GgmlType.Q2_K: ks.encode_q2_k, GgmlType.Q3_K: ks.encode_q3_k, GgmlType.Q4_K: ks.encode_q4_k,
                GgmlType.Q5_K: ks.encode_q5_k, GgmlType.Q6_K: ks.encode_q6_k, GgmlType.MXFP4: ggml_fp4.encode_mxfp4,
                GgmlType.NVFP4: ggml_fp4.encode_nvfp4}
    if kind in (GgmlType.MXFP4, GgmlType.NVFP4):  # llama.cpp takes no importance weights for them
        return encoders[kind](x, name)
    return encoders[kind](x, name, importance=importance)


def decode(data: torch.Tensor, kind: GgmlType) -> torch.Tensor:
    """uint8 [..., n_blocks * B] of GGML ``kind`` -> float32 [..., n_blocks * n], as llama.cpp dequantizes."""
    from lowbit.numerics import ggml_blocks, ggml_fp4, ggml_kquants

    kind = GgmlType(kind)
    if kind in ggml_blocks.BLOCK_BYTES:
        return ggml_blocks.decode(data, kind)
    if kind in ggml_kquants.SUPER_BYTES:
        return ggml_kquants.decode(data, kind)
    return ggml_fp4.decode_mxfp4(data) if kind is GgmlType.MXFP4 else ggml_fp4.decode_nvfp4(data)
