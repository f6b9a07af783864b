"""Calibration: data, observers and layer-by-layer calibrated quantization.

    lowbit.quantize(model, "w8a8-int8", calibration=texts, tokenizer=tok, smoothquant=0.8)
"""

from lowbit.calibration.config import (
    BUILTIN, CALIBRATION_PRESETS, CalibrationConfig, CalibrationError, LayerInputs, builtin_text_path, calibration_tokens, read_paragraphs,
    CalibrationSource, calibration_set,
)
from lowbit.calibration.config_parts import DataConfig, GPTQConfig, ObserverConfig, ReconstructionConfig, SmoothingConfig
from lowbit.calibration.float_states import FloatStates
from lowbit.calibration.observers import (ActivationObserver, MaxObserver, MSEObserver, Observer, PercentileObserver,
                                          make_observer)
from lowbit.calibration.pipeline import CalibrationReport, GroupReport, LayerwiseCalibrator
from lowbit.quant.input_scales import input_scales_from_amax, qdq_activation

__all__ = [
    "BUILTIN", "CALIBRATION_PRESETS", "CalibrationConfig", "DataConfig", "ObserverConfig", "SmoothingConfig", "GPTQConfig",
    "ReconstructionConfig", "CalibrationError", "LayerInputs", "builtin_text_path", "calibration_tokens",
    "read_paragraphs", "CalibrationSource", "FloatStates", "calibration_set", "Observer", "ActivationObserver", "MaxObserver", "PercentileObserver", "MSEObserver", "make_observer",
    "CalibrationReport", "GroupReport", "LayerwiseCalibrator", "input_scales_from_amax", "qdq_activation",
]
