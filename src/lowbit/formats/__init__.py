"""Checkpoint formats: per-layer layouts (pure functions, no model) and quantization-config parsing.
Reading and writing the files themselves is ``lowbit.files``.

    from lowbit.formats import Format, get_layout
    from lowbit.files.folder import SafetensorsFolder, read_config
    from lowbit.files.writer import CheckpointWriter
    layout = get_layout(Format.COMPRESSED_TENSORS)        # or "lowbit", "fake", "compressed-tensors"
    layout.check_scheme(scheme)                            # FormatError if the format cannot hold it
    tensors = layout.linear_tensors(prefix, qweight, scheme, bias=None, input_scale=None,
                                    input_global_scale=None, dtype=torch.bfloat16)
    qcfg = layout.quantization_config(scheme, ignore=["lm_head"])   # -> config.json["quantization_config"]
    CheckpointWriter(out, weights_stem=layout.weights_stem)         # lowbit: lowbit-model*.safetensors files

    # reading back (no model needed):
    folder = SafetensorsFolder(path)
    checkpoint_format, parsed = parse_quantization_config(read_config(path))      # detects the format
    scheme = parsed.scheme_for(prefix)                               # None: layer not quantized
    layer = get_layout(checkpoint_format).read_linear(prefix, folder, scheme, dtype, config=parsed)
    layer.qweight, layer.input_scale, layer.input_global_scale, layer.bias

See lowbit/formats/base.py for the full contract and each layout module for its tensor table;
``get_format(Format.GGUF)`` is the one format written whole as one file (lowbit.formats.gguf.format).
"""

from lowbit.errors import FormatError

from lowbit.formats.base import Format, Layout, LinearRead, ParsedConfig
from lowbit.formats.checkpoint_format import CheckpointFormat, Container
from lowbit.formats.ct_layout import CompressedTensorsLayout
from lowbit.formats.detect import detect_format, parse_quantization_config
from lowbit.formats.fake_layout import FakeLayout, static_scale_entry
from lowbit.formats.gguf.format import GgufFormat
from lowbit.formats.lowbit_layout import LowbitLayout

#: Every checkpoint format lowbit writes, each a class that owns its rules (which schemes it holds,
#: what it writes, declared; a folder ``Layout``: its tensors and their specs, its config, shared
#: and static scales, how it is recognised: ``Layout.reads``; GGUF: its GGML types per tensor, the
#: converter's plan, the file). Adding a format is its module, its ``Format`` member, a line here
#: and its tests. An explicit tuple, not registration by import side effect: which formats exist
#: is decided here, in one place, whatever was imported before.
FORMATS: tuple[CheckpointFormat, ...] = (LowbitLayout(), FakeLayout(), CompressedTensorsLayout(), GgufFormat())

#: the folder formats (``Container.FOLDER``): written one linear at a time by ``lowbit.save``, the
#: streamed path and model-free, read back by ``lowbit.load`` (``detect`` asks each)
LAYOUTS: tuple[Layout, ...] = tuple(f for f in FORMATS if f.container is Container.FOLDER)


def get_format(checkpoint_format: Format | str) -> CheckpointFormat:
    """The registered format of ``checkpoint_format`` (``Format`` or its string value)."""
    f = Format.parse(checkpoint_format)
    return next(c for c in FORMATS if c.format is f)


def get_layout(checkpoint_format: Format | str) -> Layout:
    """The layout of a folder checkpoint format (``Format`` or its string value); FormatError for a
    format written whole as one file (GGUF), which has no per-linear layout."""
    found = get_format(checkpoint_format)
    if found.container is not Container.FOLDER:
        raise FormatError(f"format {found.format.value!r} is one file written whole, not a folder: write it with "
                          f"lowbit.save(model, 'model.{found.format.value}', format={found.format.value!r}) after "
                          f"quantizing in memory, or lowbit.quantize_gguf / lowbit quantize --format gguf")
    return found


__all__ = [
    "FORMATS", "LAYOUTS", "CheckpointFormat", "Container", "Format", "Layout", "LinearRead", "ParsedConfig",
    "get_format", "get_layout", "GgufFormat", "LowbitLayout", "FakeLayout", "CompressedTensorsLayout",
    "detect_format", "parse_quantization_config", "static_scale_entry",
]
