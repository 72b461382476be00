"""DSpark speculative decoding for SGLang.

Layers (imports point down only): ``plugin``/``engine``/``admin`` know SGLang; ``model``,
``decoding``, ``scheduling``, ``calibration`` and ``training`` are pure torch and never import it.
"""

__version__ = "0.1.0"
