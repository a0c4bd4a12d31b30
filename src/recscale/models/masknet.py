"""MaskNet (Wang et al., DLP-KDD 2021): MaskBlocks with instance-guided masks, serial or parallel.

Every MaskBlock's mask is computed from the raw flattened embeddings V_emb; its masked input is
LayerNorm-ed per-field embeddings (first/parallel blocks) or the previous block's output (serial).
serial:   h_1 = MB(V_emb, LN(X0)), h_i = MB(V_emb, h_{i-1}), logit = MLP(h_last)
parallel: h = [MB_1(V_emb, LN(X0)), ..., MB_k(V_emb, LN(X0))], logit = MLP(h)
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator
from torch import Tensor, nn

from recscale.models.base import ModelParams, RecModel
from recscale.models.blocks import MLP, MaskBlock, Norm, Widths
from recscale.models.embedding import EmbeddingConfig, FeatureSet
from recscale.models.registry import register


class MaskNetParams(ModelParams):
    mode: Literal["serial", "parallel"] = "parallel"
    num_blocks: int = Field(3, ge=1)
    block_dim: int = Field(64, ge=1)  # output width of each MaskBlock
    reduction_ratio: float = Field(1.0, gt=0)  # mask aggregation width / masked width
    mlp: Widths = [64]  # hidden widths of the head on the block output(s)
    norm: Norm = "none"
    dropout: float = Field(0.0, ge=0, lt=1)

    @field_validator("block_dim")
    @classmethod
    def _block_dim_takes_its_layer_norm(cls, v: int) -> int:
        # A MaskBlock's output is layer-normed: over one unit it is a constant, and so was the model (AUC 0.5).
        if v == 1:
            raise ValueError(
                "a MaskBlock's output is layer-normed, and over 1 unit that is a constant (one value minus its "
                "mean is 0); give block_dim 2 or more"
            )
        return v


@register("masknet", MaskNetParams)
class MaskNet(RecModel):
    """X0 (B, n, d) -> MaskBlocks (B, block_dim) (serial) or (B, num_blocks·block_dim) -> MLP -> (B,)."""

    def __init__(
        self,
        features: FeatureSet,
        embedding: EmbeddingConfig,
        params: MaskNetParams,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(features, embedding, device)
        width = self.embedding.num_outputs * self.embedding.dim
        self.serial = params.mode == "serial"
        self.emb_norm = nn.LayerNorm(self.embedding.dim, device=device)
        self.blocks = nn.ModuleList(
            MaskBlock(
                width,
                params.block_dim if self.serial and i > 0 else width,
                params.block_dim,
                params.reduction_ratio,
                params.dropout,
                device,
            )
            for i in range(params.num_blocks)
        )
        head_in = params.block_dim * (1 if self.serial else params.num_blocks)
        self.head = MLP(head_in, params.mlp, 1, params.norm, params.dropout, device)

    def interact(self, x0: Tensor) -> Tensor:
        v_emb, v_in = x0.flatten(1), self.emb_norm(x0).flatten(1)
        if self.serial:
            h = v_in
            for block in self.blocks:
                h = block(v_emb, h)
        else:
            h = torch.cat([block(v_emb, v_in) for block in self.blocks], dim=1)
        return self.head(h).squeeze(-1)
