"""Which format a folder is in, from its config.json ``quantization_config``.

    checkpoint_format, parsed = parse_quantization_config(config_dict)

- ``quant_method: "lowbit"``: ``format`` "lowbit" or "fake".
- ``quant_method: "compressed-tensors"`` (llm-compressor, compressed-tensors 0.19 or 0.20 configs).
- ``quant_method: "auto-round"`` (or "intel/auto-round"): see lowbit.formats.autoround; read
  through the layout whose tensors it uses, with every default auto-round omits filled in.
- no quantization_config: an error (it is a float model; use transformers directly).
"""

from __future__ import annotations

from typing import Any, Mapping

from lowbit.errors import FormatError
from lowbit.formats.base import Format, ParsedConfig


def detect_format(config: Mapping[str, Any]) -> Format:
    return parse_quantization_config(config)[0]


def parse_quantization_config(config: Mapping[str, Any]) -> tuple[Format, ParsedConfig]:
    """(the layout to read tensors with, the typed config) for a folder's config.json dict."""
    from lowbit.formats import LAYOUTS
    from lowbit.formats.autoround import AUTOROUND_METHODS, parse_autoround

    qcfg = config.get("quantization_config")
    if qcfg is None:
        raise FormatError("config.json has no quantization_config: this is not a quantized checkpoint "
                          "(load it with transformers, or quantize it with lowbit.quantize)")
    if not isinstance(qcfg, dict):
        raise FormatError("config.json quantization_config must be a JSON object")
    for layout in LAYOUTS:  # each format recognises its own config
        if layout.reads(qcfg):
            return layout.format, layout.parse_config(qcfg)
    method = qcfg.get("quant_method")
    if method == "lowbit":
        raise FormatError(f"config.json quantization_config: unknown lowbit format {qcfg.get('format')!r} "
                          f"(expected 'lowbit' or 'fake')")
    if method in AUTOROUND_METHODS:  # another tool's folders, read through lowbit's layouts
        return parse_autoround(qcfg, config)
    raise FormatError(f"config.json quantization_config: unknown quant_method {method!r}; lowbit reads "
                      f"'lowbit', 'compressed-tensors' and 'auto-round' checkpoints")
