"""Helpers shared by the tests: tiny models, tokenizers and folders, the compressed-tensors client."""
