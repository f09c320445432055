"""Triton transformer-layer ops (contracts: ``dspark.kernels.layers``)."""

__all__: list[str] = []
