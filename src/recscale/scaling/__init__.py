"""Scaling-law studies: sweeps of model sizes (``sweep``) and power-law fits in compute (``fit``, ``plot``)."""
