"""Disaggregated Multi-Tower (DMT, Luo, Zhang et al., MLSys 2024): see docs/DMT.md."""
