"""Helpers for the eval/report/CLI tests: a byte-level fast tokenizer matching tiny_llama's
vocabulary (256), a tiny model folder on disk, and a bigram 'oracle' LM whose greedy
predictions are known exactly."""

from __future__ import annotations

import string

import torch
import torch.nn as nn


def byte_tokenizer():
    """A real PreTrainedTokenizerFast: one token per UTF-8 byte (GPT-2 byte-level alphabet)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's byte -> unicode map, so token id == byte value
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): b for b, c in zip(bs, cs)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # byte 0 (never in text) doubles as end-of-text, so the vocabulary stays exactly 256
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                   eos_token=chr(256))


BOS_ID = 1  # byte 1 never occurs in text


def bos_byte_tokenizer():
    """``byte_tokenizer`` that, like Gemma's and Llama 3's, puts a BOS token (id 1) before every
    text by default (a template post-processor); ``add_special_tokens=False`` leaves it out."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = byte_tokenizer().backend_tokenizer
    bos = chr(256 + BOS_ID)  # GPT-2's byte-level character of byte 1
    backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, BOS_ID)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                   eos_token=chr(256), bos_token=bos)


def save_tiny_folder(path, seed: int = 0, tokenizer=None, **overrides):
    from helpers.models import tiny_llama

    model = tiny_llama(seed=seed, **overrides)
    model.save_pretrained(path)
    (tokenizer or byte_tokenizer()).save_pretrained(path)
    return path


CYCLE = string.ascii_lowercase + " "


class _Decoder(nn.Module):
    def __init__(self, emb):
        super().__init__()
        self.emb = emb

    def forward(self, input_ids=None, attention_mask=None, use_cache=None):
        return (self.emb(input_ids),)


class BigramLM(nn.Module):
    """Predicts, after byte c of CYCLE, the next byte of CYCLE ('z' -> ' ' -> 'a'); every other
    byte predicts 'q'. Hidden state = one-hot of the current byte; head = the bigram table."""

    config = None

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 256)
        self.head = nn.Linear(256, 256, bias=False)
        with torch.no_grad():
            self.emb.weight.copy_(torch.eye(256))
            table = torch.full((256, 256), -5.0)
            table[:, ord("q")] = 5.0
            for i, c in enumerate(CYCLE):
                nxt = CYCLE[(i + 1) % len(CYCLE)]
                table[ord(c)] = -5.0
                table[ord(c), ord(nxt)] = 5.0
            self.head.weight.copy_(table.T.contiguous())  # logits[next] = table[cur, next]
        self.decoder = _Decoder(self.emb)

    def get_decoder(self):
        return self.decoder

    def get_output_embeddings(self):
        return self.head
