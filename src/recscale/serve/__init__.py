"""Exported models and the online scoring service (``recscale export``, ``recscale serve``)."""
