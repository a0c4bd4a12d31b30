"""``python -m recscale``: the ``recscale`` command (also as a rank under torchrun)."""

from recscale.cli import run

run()
