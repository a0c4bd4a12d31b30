"""Quantized collectives (``distributed.qcomms``): what the config refuses. The bytes and training of
two ranks with and without qcomms are checked in tests/test_distributed.py, whose 2-rank launch
trains both (``test_quantized_all_to_all_and_all_reduce_send_fewer_bytes_and_train_alike``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recscale.config import load_config
from recscale.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_fp8_on_cpu_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="fp8 has no CPU codec"):
        load_config(CONFIGS / "demo.yaml", ["distributed.qcomms.forward=fp8"])
