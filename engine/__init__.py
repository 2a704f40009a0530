"""SharpI inference engine: GGUF loading, quantized kernels, models, placement and generation.

The engine never imports Qt; the desktop app talks to it through :mod:`engine.api`.
"""

__version__ = "0.1.0"
