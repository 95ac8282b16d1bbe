"""Porting a new model: op taps, first-divergence search and the porting gates.

* :mod:`.taps`     the tap points' sink (``SINK``: ``None`` = off, the default) and the recorder;
* :mod:`.compare`  first divergent op between two recordings (bitwise or within a tolerance);
* :mod:`.repro`    a found divergence written as safetensors + a script that fails on its own;
* :mod:`.bisect`   ``unified-models bisect`` (``--against trainer | reference | peer``);
* :mod:`.gates`    ``unified-models gates`` (C0-C9 on the CPU, one JSON record per gate).

This ``__init__`` imports nothing: the layers import :mod:`.taps` (a leaf module)
on every forward path, so the package must stay free of engine imports.
"""
