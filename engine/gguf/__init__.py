"""GGUF files: memory-mapped reading, metadata keys, tensor references."""

from engine.gguf.reader import GGUFFile, TensorRef, open_gguf

__all__ = ["GGUFFile", "TensorRef", "open_gguf"]
