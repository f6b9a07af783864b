"""GGUF (llama.cpp) files. ``convert``: the metadata, tokenizer and tensor names from llama.cpp's
own converter, and where each quantized weight's rows go (``plan_gguf``); see docs/gguf.md."""
