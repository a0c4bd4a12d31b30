"""Shared building blocks of the models; each has ``flops_per_example()``."""

from recscale.models.blocks.attention import MultiHeadSelfAttention
from recscale.models.blocks.calibration import Calibration
from recscale.models.blocks.cast import as_compute
from recscale.models.blocks.cin import CIN
from recscale.models.blocks.cross import CrossNet
from recscale.models.blocks.dot import DotInteraction
from recscale.models.blocks.dropout import Dropout
from recscale.models.blocks.fm import FullFM, OptimizedFM, fm_pairwise
from recscale.models.blocks.fusion import BilinearFusion
from recscale.models.blocks.gating import FeatureSelection
from recscale.models.blocks.lcb import LinearCompressBlock
from recscale.models.blocks.mask import MaskBlock
from recscale.models.blocks.mlp import MLP, Norm, Widths

__all__ = [
    "CIN",
    "MLP",
    "BilinearFusion",
    "Calibration",
    "CrossNet",
    "DotInteraction",
    "Dropout",
    "FeatureSelection",
    "FullFM",
    "LinearCompressBlock",
    "MaskBlock",
    "MultiHeadSelfAttention",
    "Norm",
    "OptimizedFM",
    "Widths",
    "as_compute",
    "fm_pairwise",
]
