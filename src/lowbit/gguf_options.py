"""The options of a calibrated GGUF file that every entry point shares (``quantize_gguf``, the
CLI's ``--format gguf``, ``lowbit.quantize`` with a GGML target): one default each."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowbit.errors import FormatError
from lowbit.numerics.ggml import ImportanceSearch

if TYPE_CHECKING:
    from lowbit.algorithms.gptq import WeightRounding

#: how a calibrated GGUF file's importance matrix chooses the scales (bench/gguf/RESULTS-gguf.md,
#: "The importance search": KLD at the same bytes against llama.cpp's own search)
DEFAULT_IMPORTANCE_SEARCH = ImportanceSearch.DIRECT


#: block-reconstruction steps per decoder layer of a calibrated GGUF file when none are asked for
#: (``reconstruct_iters`` None): off. 20 steps lower the KLD at the same bytes by a quarter to a third
#: on SmolLM2-135M (Q2_K / Q3_K_M / Q4_K_M) for about 3x the calibration's time, but by 10% on
#: Gemma-3-270M Q3_K_M and not at all at its Q2_K (+4%) (bench/gguf/RESULTS-gguf.md, "Block
#: reconstruction of the GGML codes"); without them the file already leads llama-imatrix +
#: llama-quantize at every mix, within the issue's 2x of their time
DEFAULT_GGUF_RECONSTRUCT_ITERS = 0


def parse_importance_search(value: ImportanceSearch | str) -> ImportanceSearch:
    """``value`` as an ``ImportanceSearch``; FormatError naming the choices otherwise."""
    try:
        return ImportanceSearch(value)
    except ValueError:
        raise FormatError(f"unknown importance search {value!r}: one of "
                          f"{', '.join(s.value for s in ImportanceSearch)}") from None


def gguf_rounding(config) -> WeightRounding:
    """The weight rounding of a calibrated GGUF file: ``config.weight_rounding``, GPTQ when not
    given (bench/gguf/RESULTS-gguf.md: KLD at the same bytes, every mix measured)."""
    from lowbit.algorithms.gptq import WeightRounding

    return config.weight_rounding or WeightRounding.GPTQ


#: the CalibrationConfig fields a GGUF file's calibration reads, besides its data part's (the windows)
READ_FIELDS = ("weight_rounding", "gptq_damping", "gptq_block_size", "reconstruct_iters", "reconstruct_lr",
               "reconstruct_batch_size")


def check_gguf_config(label: str, cfg) -> None:
    """QuantizationError naming the first field of the CalibrationConfig ``cfg`` a GGUF file's
    calibration does not read (its importance matrix and GPTQ: the windows, ``READ_FIELDS``) that
    is set away from its default; ``label`` names the mix or GGML type in the message."""
    from lowbit.calibration import CalibrationConfig
    from lowbit.calibration.config_parts import PART_OF
    from lowbit.errors import QuantizationError

    base = CalibrationConfig()
    unread = [n for n, part in PART_OF.items() if part != "data" and n not in READ_FIELDS]
    for name in unread + ["layer_inputs", "rotation"]:  # the parts' flat fields, then the config's own
        if getattr(cfg, name) != getattr(base, name):
            raise QuantizationError(f"{label!r} (llama.cpp's GGML types) takes no calibration option {name!r}: a GGUF "
                                    f"file's calibration is its importance matrix and GPTQ's codes (options "
                                    f"{', '.join(READ_FIELDS)}, importance_search and the windows')")


def gguf_calibration_config(label: str, config, preset: str | None, options: dict):
    """(CalibrationConfig, ImportanceSearch) of the calibration arguments an API entry point got for
    a GGUF target (``lowbit.quantize``, ``quantize_checkpoint``): ``importance_search`` taken out of
    ``options`` (default ``DEFAULT_IMPORTANCE_SEARCH``), the rest read as ``lowbit.quantize`` reads
    them and checked by ``check_gguf_config``. QuantizationError naming the option."""
    from lowbit.calibration.config import calibration_config
    from lowbit.errors import QuantizationError

    options = dict(options)
    try:
        search = parse_importance_search(options.pop("importance_search", DEFAULT_IMPORTANCE_SEARCH))
    except FormatError as e:
        raise QuantizationError(f"importance_search: {e}") from None
    cfg = calibration_config(config, preset, options)
    check_gguf_config(label, cfg)
    return cfg, search
