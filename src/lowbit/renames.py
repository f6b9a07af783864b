"""The checkpoint keys transformers renames when it loads a folder, read from transformers itself.

    checkpoint_renames(model, disk_keys)   # model key -> checkpoint key (a float checkpoint)
    folder_renames(model, keys)            # folder key -> model key (a quantized folder)

Some families' checkpoints keep names their transformers model no longer has (Nemotron-H's
``backbone.``, GraniteMoE's ``block_sparse_moe.input_linear``); ``from_pretrained`` renames them
with the model's conversion mapping (``transformers.conversion_mapping.get_model_conversion_mapping``)
and ``save_pretrained`` writes them back. Readers that go to the shards by the model's names (the
streamed skeleton, ``lowbit.load`` of a model-free output that kept the checkpoint's names) look
them up here: each key is renamed exactly as ``convert_and_load_state_dict_in_model`` renames it
(``rename_source_key``, with the base-model-prefix rule), so there is no table of lowbit's.

Only renames that leave the tensor as it is are followed: a ``WeightRenaming``, or a
``WeightConverter`` whose operations only stack per-expert tensors (``MergeModulelist``), whose
per-expert keys (renamed, the converter not applied) are the keys of the experts lowbit splits
back (``lowbit.moe.split_experts``). A key another converter transforms (concatenates, transposes,
chunks) is left as it is, and a reader that needs it names it in its error.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch.nn as nn


def _renamed(model: nn.Module, keys: Iterable[str], legacy: bool) -> Iterator[tuple[str, str]]:
    """(key, the name transformers loads it as) for each of ``keys`` it renames without
    transforming the tensor."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (MergeModulelist, WeightConverter, WeightRenaming,
                                                     rename_source_key)
    except ImportError:  # a transformers without conversion mappings loads keys as they are
        return
    mapping = get_model_conversion_mapping(model, add_legacy=legacy)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    stacking = [c for c in converters if all(isinstance(op, MergeModulelist) for op in c.operations)]
    prefix = getattr(model, "base_model_prefix", None) or None
    meta = model.state_dict(keep_vars=True)
    for disk in keys:
        key, _ = rename_source_key(disk, renamings, [], prefix, meta)
        converter = next((c for c in converters if c.rename_source_key(key)[1] is not None), None)
        if converter is not None and converter not in stacking:
            continue  # its tensor is transformed, not only renamed
        if converter is None and key not in meta and disk in meta:  # as transformers: not renamed after all
            continue
        if key != disk:
            yield disk, key


def checkpoint_renames(model: nn.Module, disk_keys: Iterable[str]) -> dict[str, str]:
    """model key -> checkpoint key, for the keys of ``disk_keys`` (a float checkpoint's)
    transformers renames when it loads them into ``model`` (built from its config)."""
    return {key: disk for disk, key in _renamed(model, disk_keys, legacy=True)}


def folder_renames(model: nn.Module, keys: Iterable[str]) -> dict[str, str]:
    """folder key -> model key, for the keys of a quantized folder (``weight_codes`` and the like
    beside the float ones) that name a module ``model`` lacks under a name transformers renames to
    one of its modules (the legacy renames of old checkpoints, which could rename lowbit's own
    suffixes, are left out)."""
    modules = {n for n, _ in model.named_modules()}
    return {disk: key for disk, key in _renamed(model, keys, legacy=False)
            if disk.rpartition(".")[0] not in modules and key.rpartition(".")[0] in modules}


def load_names(model_type: str | None, keys: Iterable[str]) -> dict[str, str]:
    """key -> the name transformers' renames give it when it loads a checkpoint of ``model_type``,
    for the keys they rename (without a model: the mapping registered for the model type, its
    ``WeightRenaming`` only; what model-free planning, which builds no model, reads)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:
        return {}
    renamings = [t for t in (get_checkpoint_conversion_mapping(model_type) or []) if isinstance(t, WeightRenaming)]
    out = {}
    for k in keys:
        new = apply_renamings(k, renamings) if renamings else k
        if new != k:
            out[k] = new
    return out
