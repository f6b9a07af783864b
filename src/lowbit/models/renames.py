"""The checkpoint keys transformers renames when it loads a folder, read from transformers itself.

    renames = checkpoint_renames(model, disk_keys)   # model key -> checkpoint key

Some families' checkpoints keep names their transformers model no longer has (Nemotron-H's
``backbone.``, GraniteMoE's ``block_sparse_moe.input_linear``); ``from_pretrained`` renames them
with the model's conversion mapping (``transformers.conversion_mapping.get_model_conversion_mapping``)
and ``save_pretrained`` writes them back. Readers that go to the shards by the model's names (the
streamed skeleton) look them up here: each checkpoint key is renamed exactly as
``convert_and_load_state_dict_in_model`` renames it (``rename_source_key``, with the
base-model-prefix rule), so there is no table of lowbit's.

Only renames that leave the tensor as it is are returned: a ``WeightRenaming``, or a
``WeightConverter`` whose operations only stack per-expert tensors (``MergeModulelist``), whose
per-expert keys (renamed, the converter not applied) are the keys of the experts lowbit splits
back (``lowbit.moe.split_experts``). A key another converter transforms (concatenates, transposes,
chunks) is left out, and a reader that needs it names it in its error.
"""

from __future__ import annotations

import torch.nn as nn


def checkpoint_renames(model: nn.Module, disk_keys) -> dict[str, str]:
    """model key -> checkpoint key, for the keys of ``disk_keys`` transformers renames when it
    loads them into ``model`` (built from its config, before ``split_experts``)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (MergeModulelist, WeightConverter, WeightRenaming,
                                                     rename_source_key)
    except ImportError:  # a transformers without conversion mappings loads keys as they are
        return {}
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    stacking = [c for c in converters if all(isinstance(op, MergeModulelist) for op in c.operations)]
    prefix = getattr(model, "base_model_prefix", None) or None
    meta = model.state_dict(keep_vars=True)
    out: dict[str, str] = {}
    for disk in disk_keys:
        key, _ = rename_source_key(disk, renamings, [], prefix, meta)
        converter = next((c for c in converters if c.rename_source_key(key)[1] is not None), None)
        if converter is not None and converter not in stacking:
            continue  # its tensor is transformed, not only renamed
        if converter is None and key not in meta and disk in meta:  # as transformers: not renamed after all
            continue
        if key != disk:
            out[key] = disk
    return out
