"""llama.cpp's named mixes (llama-quantize's file types): the GGML type of every tensor of a GGUF
file, chosen by the rules of llama-quantize (llama.cpp as vendored by llama-cpp-python 0.3.36,
``src/llama-quant.cpp``: ``llama_tensor_get_type`` and its shape fallbacks).

    types = choose_types(Mix.Q4_K_M, tensors, ModelFacts(n_layer=30, n_head=9, n_head_kv=3))
    types["blk.0.attn_v.weight"]            # GgmlType.Q6_K (more bits in the first eighth)

``tensors``: (GGUF name, shape in numpy order: the last axis is the input dimension, GGUF's ne0),
in any order; the rules count layers in llama-quantize's order (layer number, then name). A
tensor llama-quantize leaves as it is (norms, 1-D tensors, routers, convolutions...) maps to
None. A type whose block does not divide the row falls back as llama-quantize falls back
(Q2_K / Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, then F16: ``F16`` here).

The rules read tensor roles, not names: a GGUF name is parsed once into its role (``Role``), the
GGUF tensor-name standard's own words (``attn_v``, ``ffn_down``, ...), and the rules dispatch on
it. What llama-quantize decides from the model (70B-only promotions, Falcon) is taken from
``ModelFacts``; imatrix-only branches follow ``has_importance``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Iterable

from lowbit.errors import FormatError
from lowbit.numerics.ggml import GEOMETRY, GgmlType

F16 = "f16"  # the last fallback: a row no GGML block divides is stored in half precision


class Mix(str, enum.Enum):
    """llama-quantize's file types lowbit writes (``--scheme gguf-q4_k_m`` ...)."""

    Q8_0 = "Q8_0"
    Q6_K = "Q6_K"
    Q5_K_M = "Q5_K_M"
    Q5_K_S = "Q5_K_S"
    Q4_K_M = "Q4_K_M"
    Q4_K_S = "Q4_K_S"
    Q3_K_L = "Q3_K_L"
    Q3_K_M = "Q3_K_M"
    Q3_K_S = "Q3_K_S"
    Q2_K = "Q2_K"
    Q5_1 = "Q5_1"
    Q5_0 = "Q5_0"
    Q4_1 = "Q4_1"
    Q4_0 = "Q4_0"
    MXFP4_MOE = "MXFP4_MOE"

    @classmethod
    def parse(cls, value: "Mix | str") -> "Mix":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).upper())
        except ValueError:
            raise FormatError(f"unknown GGUF mix {value!r}; choose one of: "
                              f"{', '.join(m.value for m in cls)}") from None


#: the type of every tensor a mix does not single out (llama_ftype_get_default_type)
DEFAULT_TYPE = {Mix.Q8_0: GgmlType.Q8_0, Mix.Q6_K: GgmlType.Q6_K, Mix.Q5_K_M: GgmlType.Q5_K,
                Mix.Q5_K_S: GgmlType.Q5_K, Mix.Q4_K_M: GgmlType.Q4_K, Mix.Q4_K_S: GgmlType.Q4_K,
                Mix.Q3_K_L: GgmlType.Q3_K, Mix.Q3_K_M: GgmlType.Q3_K, Mix.Q3_K_S: GgmlType.Q3_K,
                Mix.Q2_K: GgmlType.Q2_K, Mix.Q5_1: GgmlType.Q5_1, Mix.Q5_0: GgmlType.Q5_0,
                Mix.Q4_1: GgmlType.Q4_1, Mix.Q4_0: GgmlType.Q4_0, Mix.MXFP4_MOE: GgmlType.MXFP4}

#: where a type goes when its block does not divide a row (tensor_type_fallback)
FALLBACK = {GgmlType.Q2_K: GgmlType.Q4_0, GgmlType.Q3_K: GgmlType.Q4_0, GgmlType.Q4_K: GgmlType.Q5_0,
            GgmlType.Q5_K: GgmlType.Q5_1, GgmlType.Q6_K: GgmlType.Q8_0}


class Role(enum.Enum):
    """What a tensor is, as llama-quantize's categories read it from the GGUF tensor-name standard."""

    OUTPUT = "output"
    TOKEN_EMBD = "token_embd"
    ATTN_QKV = "attn_qkv"
    ATTN_KV_B = "attn_kv_b"
    ATTN_V = "attn_v"
    ATTN_K = "attn_k"
    ATTN_Q = "attn_q"
    ATTN_OUTPUT = "attn_output"
    FFN_UP = "ffn_up"
    FFN_GATE = "ffn_gate"
    FFN_DOWN = "ffn_down"
    OTHER = "other"


_ATTN = {"attn_qkv": Role.ATTN_QKV, "attn_kv_b": Role.ATTN_KV_B, "attn_v": Role.ATTN_V, "attn_k": Role.ATTN_K,
         "attn_q": Role.ATTN_Q, "attn_output": Role.ATTN_OUTPUT}
_FFN = (("ffn_up", Role.FFN_UP), ("ffn_gate", Role.FFN_GATE), ("ffn_down", Role.FFN_DOWN))
_BLOCK = re.compile(r"blk\.(\d+)\.")
# tensors llama-quantize never quantizes: kind words of the GGUF standard (tensor_allows_quantization)
_KEEP_WORDS = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
               "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
               "indexer.q_proj.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
               "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
               *(f"time_mix_{k}.weight" for k in ("first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2",
                                                   "g1", "g2", "decay_w1", "decay_w2", "lerp_fused")))
_KEEP_NAMES = ("position_embd.weight", "token_types.weight")


def role_of(name: str) -> Role:
    """The role of GGUF tensor ``name`` (``blk.3.ffn_down_exps.weight`` -> FFN_DOWN), by
    llama-quantize's reading: the output and token embeddings by name, attention projections by
    their ``.weight`` kind word, FFN projections (experts and shared experts too) by theirs."""
    if name == "output.weight":
        return Role.OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return Role.TOKEN_EMBD
    for word, role in _ATTN.items():
        if f"{word}.weight" in name:
            return role
    for word, role in _FFN:
        if word in name:
            return role
    return Role.OTHER


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama-quantize quantizes tensor ``name`` at all: a weight of 2 or more axes that
    is not a norm, a router, a convolution, a position table or one of the other kinds it keeps."""
    dims = list(shape)
    while len(dims) > 1 and dims[0] == 1:  # GGML counts axes without the trailing ones of ne (leading here)
        dims.pop(0)
    if len(dims) < 2 or not name.endswith("weight") or name in _KEEP_NAMES:
        return False
    return not any(w in name for w in _KEEP_WORDS)


def layer_of(name: str) -> int:
    """The block number of ``blk.N.*`` tensors, -1 for the others (they sort first)."""
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else -1


@dataclass(frozen=True)
class ModelFacts:
    """What the rules read from the model (GGUF metadata): layers, query and KV heads (their
    ratio is ``n_gqa``), experts, whether the architecture is Falcon (its own rules), and whether
    an importance matrix is given (``has_importance``: two rules depend on it)."""

    n_layer: int
    n_head: int = 1
    n_head_kv: int = 1
    n_expert: int = 0
    falcon: bool = False
    has_importance: bool = False

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


class _State:
    """llama-quantize's counters, advanced in its tensor order."""

    def __init__(self, facts: ModelFacts, n_attention_wv: int, tied: bool) -> None:
        self.facts, self.n_attention_wv, self.tied = facts, n_attention_wv, tied
        self.i_attention_wv = self.i_ffn_down = 0

    def ffn_layer(self, name: str, counter: int) -> tuple[int, int]:
        """(layer, layers) of an FFN tensor: its own block for MoE models, else the counter."""
        if max(1, self.facts.n_expert) > 1:
            return layer_of(name), self.facts.n_layer
        return counter, self.facts.n_layer


def _output_type(mix: Mix, t: GgmlType, cols: int, facts: ModelFacts) -> GgmlType:
    if mix is Mix.MXFP4_MOE or facts.falcon or cols % GEOMETRY[t][0]:
        return GgmlType.Q8_0
    return t if t is GgmlType.Q8_0 else GgmlType.Q6_K


def _attn_v(mix: Mix, t: GgmlType, s: _State) -> GgmlType:
    f = s.facts
    if mix is Mix.Q2_K:
        t = GgmlType.Q4_K if f.n_gqa >= 4 else GgmlType.Q3_K
    elif mix is Mix.Q3_K_M:
        t = GgmlType.Q5_K if s.i_attention_wv < 2 else GgmlType.Q4_K
    elif mix is Mix.Q3_K_L:
        t = GgmlType.Q5_K
    elif mix in (Mix.Q4_K_M, Mix.Q5_K_M) and _more_bits(s.i_attention_wv, s.n_attention_wv):
        t = GgmlType.Q6_K
    elif mix is Mix.Q4_K_S and s.i_attention_wv < 4:
        t = GgmlType.Q5_K
    if f.n_expert == 8:
        t = GgmlType.Q8_0
    s.i_attention_wv += 1
    return t


def _ffn_down(mix: Mix, t: GgmlType, name: str, s: _State) -> GgmlType:
    f = s.facts
    i, n = s.ffn_layer(name, s.i_ffn_down)
    if mix is Mix.Q2_K:
        t = GgmlType.Q3_K
    elif mix is Mix.Q3_K_M:
        t = (GgmlType.Q5_K if i < n // 16 else
             GgmlType.Q4_K if not f.falcon or _more_bits(i, n) else GgmlType.Q3_K)
    elif mix is Mix.Q3_K_L:
        t = GgmlType.Q4_K if f.falcon else GgmlType.Q5_K
    elif mix is Mix.Q4_K_M:
        if f.falcon:
            t = GgmlType.Q6_K if i < n // 16 else GgmlType.Q5_K if _more_bits(i, n) else GgmlType.Q4_K
        elif _more_bits(i, n):
            t = GgmlType.Q6_K
    elif mix is Mix.Q5_K_M and _more_bits(i, n):
        t = GgmlType.Q6_K
    elif mix is Mix.Q4_K_S and not f.falcon and i < n // 8:
        t = GgmlType.Q5_K
    elif mix in (Mix.Q4_0, Mix.Q5_0) and f.has_importance and i < n // 8:
        t = GgmlType.Q4_1 if mix is Mix.Q4_0 else GgmlType.Q5_1
    s.i_ffn_down += 1
    return t


def _attn_output(mix: Mix, t: GgmlType, f: ModelFacts) -> GgmlType:
    if f.falcon:
        return GgmlType.Q4_K if mix is Mix.Q3_K_L else t
    if f.n_expert == 8:
        promoted = (Mix.Q2_K, Mix.Q3_K_S, Mix.Q3_K_M, Mix.Q4_K_S, Mix.Q4_K_M)
        return GgmlType.Q5_K if mix in promoted else t
    return {Mix.Q2_K: GgmlType.Q3_K, Mix.Q3_K_M: GgmlType.Q4_K, Mix.Q3_K_L: GgmlType.Q5_K}.get(mix, t)


def _rule(mix: Mix, name: str, shape: tuple[int, ...], role: Role, s: _State) -> GgmlType:
    """llama_tensor_get_type_impl for the mixes of ``Mix``."""
    t, f = DEFAULT_TYPE[mix], s.facts
    if role is Role.OUTPUT or (s.tied and role is Role.TOKEN_EMBD):
        return _output_type(mix, t, shape[-1], f)
    if mix is Mix.MXFP4_MOE:
        return GgmlType.MXFP4 if len(shape) >= 3 and shape[-3] > 1 else GgmlType.Q8_0
    if role in (Role.ATTN_V, Role.ATTN_QKV, Role.ATTN_KV_B):
        return _attn_v(mix, t, s)
    if role is Role.ATTN_K:
        return GgmlType.Q8_0 if f.n_expert == 8 else t
    if role is Role.FFN_DOWN:
        return _ffn_down(mix, t, name, s)
    if role is Role.ATTN_OUTPUT:
        return _attn_output(mix, t, f)
    return t


def fallback(t: GgmlType, cols: int) -> GgmlType | str:
    """``t``, or the type llama-quantize falls back to when its block does not divide ``cols``."""
    if cols % GEOMETRY[t][0] == 0:
        return t
    down = FALLBACK.get(t, t)
    return down if cols % GEOMETRY[down][0] == 0 else F16


def choose_types(mix: Mix | str, tensors: Iterable[tuple[str, tuple[int, ...]]],
                 facts: ModelFacts) -> dict[str, GgmlType | str | None]:
    """The type of every tensor under ``mix`` (see the module docstring): a GgmlType, ``F16``
    (no block fits the row), or None (llama-quantize keeps the tensor as the converter wrote it)."""
    mix = Mix.parse(mix)
    items = sorted(((n, tuple(int(d) for d in s)) for n, s in tensors), key=lambda ns: (layer_of(ns[0]), ns[0]))
    roles = {n: role_of(n) for n, _ in items}
    n_wv = sum(r in (Role.ATTN_V, Role.ATTN_QKV, Role.ATTN_KV_B) for r in roles.values())
    state = _State(facts, n_wv, tied=Role.OUTPUT not in roles.values())
    out: dict[str, GgmlType | str | None] = {}
    for name, shape in items:
        if not quantizable(name, shape):
            out[name] = None
            continue
        out[name] = fallback(_rule(mix, name, shape, roles[name], state), shape[-1])
    return out
