"""Sequence blocks: one user history (ids embedded position by position) -> one d-vector.

- ``TargetAttention``: DIN (Zhou et al., KDD 2018) target-aware attention: each history position is
  scored against the candidate (the target feature's embedding) by a small MLP, and the history is
  summed with those weights: unnormalised as in the paper (so the sum keeps how much of the history
  relates to the candidate), or softmax-normalised over the valid positions (``softmax``);
- ``CausalBlock``: a SASRec-style (Kang & McAuley, ICDM 2018) causal self-attention layer with a
  feed-forward layer, post-norm residuals; position j attends to positions <= j only.

``SequenceEncoder`` pads a jagged history (``JaggedTensor`` values (Σ lengths, d)) into length buckets,
each padded only to its own longest history, runs ``causal`` blocks and/or ``din`` attention, and
returns (B, d): the DIN readout, or for ``causal`` the last (most recent) position's state, the
SASRec readout. An empty history gives the zero vector.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import Field
from torch import Tensor, nn
from torch.nn import functional as F

from recscale.models.blocks.mlp import MLP, Widths
from recscale.models.flops import linear_flops, matmul_flops
from recscale.settings import Settings


class SequenceConfig(Settings):
    """``model.embedding.sequence``: how each sequence feature becomes one vector of X0."""

    # din: target attention over the embedded ids; causal: causal transformer blocks, last state;
    # causal_din: causal blocks, then target attention over their outputs.
    encoder: Literal["din", "causal", "causal_din"] = "din"
    # The single-id feature whose embedding is the candidate for target attention (e.g. item_id).
    target: str | None = None
    attention_hidden: Widths = [32]  # DIN's scoring MLP
    softmax: bool = False  # normalise DIN's weights over the history (the paper does not)
    layers: int = Field(1, ge=1)  # causal blocks
    heads: int = Field(2, ge=1)
    # Length buckets per batch, each padded to its own longest history: N (sorted by length, equal
    # counts), or pow2 (lengths in (2^(k-1), 2^k] share bucket k: padding under 2x whatever the batch).
    buckets: Annotated[int, Field(ge=1)] | Literal["pow2"] = 1


class TargetAttention(nn.Module):
    """(history (B, L, d), attendable (B, L) bool, target (B, d)) -> (B, d).

    w_j = MLP([h_j, t, h_j - t, h_j * t]) over the attendable positions (0 elsewhere; softmax over them
    with ``softmax``), then Σ_j w_j h_j."""

    def __init__(
        self, dim: int, hidden: list[int], max_len: int, softmax: bool, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.mlp = MLP(4 * dim, hidden, 1, device=device)
        self.max_len, self.softmax = max_len, softmax

    def forward(self, h: Tensor, attendable: Tensor, target: Tensor) -> Tensor:
        t = target[:, None, :].expand_as(h)
        scores = self.mlp(torch.cat([h, t, h - t, h * t], dim=-1)).squeeze(-1)
        if self.softmax:
            weights = torch.softmax(scores.masked_fill(~attendable, float("-inf")), dim=-1)
        else:
            weights = scores * attendable
        return (weights.unsqueeze(-1) * h).sum(dim=1)

    def length_flops(self) -> tuple[int, int]:
        """Forward FLOPs per history position and per position² (none: scoring is per position). The
        weighted sum is element-wise work, free by the FLOP convention (``recscale.models.flops``)."""
        return self.mlp.flops_per_example(), 0

    def flops_per_example(self) -> int:
        """At the longest history (max_len positions)."""
        return self.max_len * self.length_flops()[0]


class CausalBlock(nn.Module):
    """(x (B, L, d)) -> (B, L, d): x' = LN(x + W_o MHA_causal(x)); out = LN(x' + FFN(x')).

    Histories are left-aligned (each row's padding after its last id, as ``SequenceEncoder`` pads them),
    so causal attention alone keeps every real position from seeing padding; padded positions come out
    as garbage that the readouts never read."""

    def __init__(self, dim: int, heads: int, max_len: int, device: torch.device | None = None) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"embedding dim {dim} does not split into {heads} heads")
        self.heads, self.max_len, self.dim = heads, max_len, dim
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, device=device)
        self.out = nn.Linear(dim, dim, device=device)
        self.ffn = MLP(dim, [dim], dim, device=device)
        self.norm1 = nn.LayerNorm(dim, device=device)
        self.norm2 = nn.LayerNorm(dim, device=device)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # No padding mask: besides sparing the (B, 1, L, L) mask, is_causal lets the kernel skip the
        # blocks above the diagonal; real positions get the same bits as with the mask.
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = self.norm1(x + self.out(att.transpose(1, 2).reshape(b, n, d)))
        return self.norm2(x + self.ffn(x))

    def length_flops(self) -> tuple[int, int]:
        """Forward FLOPs per history position (projections, FFN) and per position² (attention scores
        and weighted sum, all heads: 2 x (1, d) @ (d, 1) per query-key pair)."""
        per_position = linear_flops(self.qkv) + linear_flops(self.out) + self.ffn.flops_per_example()
        return per_position, 2 * matmul_flops(1, 1, self.dim)

    def flops_per_example(self) -> int:
        """At the longest history (max_len positions)."""
        linear, quadratic = self.length_flops()
        return self.max_len * linear + self.max_len**2 * quadratic


class SequenceEncoder(nn.Module):
    """(values (Σ lengths, d), lengths (B,), target (B, d) or None) -> (B, d); see the module doc."""

    def __init__(
        self, cfg: SequenceConfig, dim: int, max_len: int, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.cfg, self.dim = cfg, dim
        causal = cfg.encoder in ("causal", "causal_din")
        # Learnt position embeddings by recency: index 0 is the most recent id.
        self.positions = nn.Embedding(max_len, dim, device=device) if causal else None
        if self.positions is not None:
            nn.init.normal_(self.positions.weight, std=0.02)
        self.blocks = nn.ModuleList(
            [CausalBlock(dim, cfg.heads, max_len, device) for _ in range(cfg.layers)] if causal else []
        )
        self.din = (
            TargetAttention(dim, cfg.attention_hidden, max_len, cfg.softmax, device)
            if cfg.encoder != "causal"
            else None
        )

    def length_flops(self) -> tuple[int, int]:
        """Forward FLOPs of one history as (per position, per position²): a history of L ids costs
        about L x the first + L² x the second (padding to the bucket's longest history aside)."""
        parts = [*self.blocks, *([self.din] if self.din is not None else [])]
        costs = [part.length_flops() for part in parts]
        return sum(c[0] for c in costs), sum(c[1] for c in costs)

    def forward(self, values: Tensor, lengths: Tensor, target: Tensor | None) -> Tensor:
        b = lengths.numel()
        offsets = torch.cumsum(lengths, 0) - lengths
        padded = torch.cat([values, values.new_zeros(1, self.dim)])  # row -1: the padding
        if self.cfg.buckets == 1:
            return self._encode(padded, offsets, lengths, target)
        out = values.new_empty(b, self.dim)
        for rows in self._buckets(lengths):
            t = None if target is None else target[rows]
            out[rows] = self._encode(padded, offsets[rows], lengths[rows], t)
        return out

    def _buckets(self, lengths: Tensor) -> list[Tensor]:
        """The batch's rows grouped into length buckets (``cfg.buckets``)."""
        if self.cfg.buckets == "pow2":
            k = torch.ceil(torch.log2(lengths.clamp(min=1).double())).long()
            return [torch.nonzero(k == v).flatten() for v in torch.unique(k)]
        return list(torch.argsort(lengths).tensor_split(min(self.cfg.buckets, max(lengths.numel(), 1))))

    def _encode(self, padded: Tensor, starts: Tensor, lengths: Tensor, target: Tensor | None) -> Tensor:
        """Rows given by (starts, lengths) into ``padded`` (its last row zeros), at their longest length."""
        n = max(int(lengths.max()) if lengths.numel() else 1, 1)
        pos = torch.arange(n, device=lengths.device)
        valid = pos < lengths[:, None]  # (B, L)
        x = padded[torch.where(valid, starts[:, None] + pos, padded.shape[0] - 1)]  # (B, L, d)
        if self.positions is not None:
            x = x + self.positions((lengths[:, None] - 1 - pos).clamp(min=0)) * valid[..., None]
        for block in self.blocks:
            x = block(x)
        if self.din is None:
            out = x[torch.arange(x.shape[0], device=x.device), (lengths - 1).clamp(min=0)]
        else:
            assert target is not None  # EmbeddingLayer requires a target for din encoders
            attendable = valid | (pos == 0)  # an empty history attends to one zero row, masked out below
            out = self.din(x, attendable, target)
        return out * (lengths > 0)[:, None].to(out.dtype)
