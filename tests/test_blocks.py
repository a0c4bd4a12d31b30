"""Blocks and the embedding layer against their definitions."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recscale.models import EmbeddingConfig, EmbeddingLayer, FeatureSet, SparseInput
from recscale.models.blocks import (
    CIN,
    CrossNet,
    DotInteraction,
    Dropout,
    LinearCompressBlock,
    MultiHeadSelfAttention,
    OptimizedFM,
    fm_pairwise,
)


def test_optimized_fm_equals_explicit_product() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 9, 8, dtype=torch.float64)
    fm = OptimizedFM(n=9, k=3, dim=8).double()
    torch.testing.assert_close(fm(x), (x @ x.transpose(1, 2)) @ fm.y)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_dropout_keeps_one_minus_p_and_rescales(p: float) -> None:
    torch.manual_seed(0)
    x = torch.randn(512, 1024, requires_grad=True)
    drop = Dropout(p)
    torch.manual_seed(1)
    y = drop(x)
    kept = y != 0
    # 524,288 draws: the kept share's standard error is ~7e-4, so 0.004 is > 5 sigma.
    assert abs(kept.float().mean().item() - (1 - p)) < 0.004
    torch.testing.assert_close(y[kept], x[kept] / (1 - p))
    y.backward(torch.ones_like(y))  # the gradient passes where the input did, scaled alike
    torch.testing.assert_close(x.grad, kept.float() / (1 - p))
    # Seeded like every other torch draw; identity in eval mode and at p = 0.
    torch.manual_seed(1)
    torch.testing.assert_close(drop(x), y)
    assert drop.eval()(x) is x and Dropout(0.0)(x) is x
    assert not torch.equal(kept, drop.train()(x) != 0)  # a fresh mask each call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dropout_product_is_the_plain_formula_to_the_bit(dtype: torch.dtype) -> None:
    from recscale.models.blocks.dropout import _scaled_and_masked

    torch.manual_seed(0)
    x = torch.randn(300, 257).to(dtype)
    x[0, :5] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0])
    keep = torch.rand(300, 257) > 0.3
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    for scale in (1 / 0.7, 1 / 0.9):
        # Signed zeros and NaNs included: the fast form changes no bit of what training sees.
        assert torch.equal(_scaled_and_masked(x, keep, scale).view(bits), (x * keep * scale).view(bits))


def test_dropout_mask_threshold_and_bad_p() -> None:
    from recscale.models.blocks.dropout import keep_mask

    torch.manual_seed(1)
    # p is honoured to within 2^-17: over 2^22 draws the drop share sits within 5 sigma of 0.3.
    share = 1 - keep_mask(torch.Size([1 << 22]), 0.3, torch.device("cpu")).float().mean().item()
    assert abs(share - 0.3) < 5 * (0.3 * 0.7 / (1 << 22)) ** 0.5 + 2**-17
    assert keep_mask(torch.Size([3, 5]), 0.0, torch.device("cpu")).all()
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(1.0)


def test_fm_pairwise_and_dot_interaction() -> None:
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    pairs = [(i, j) for i in range(5) for j in range(i + 1, 5)]
    explicit = torch.stack([(x[:, i] * x[:, j]).sum(-1) for i, j in pairs], dim=1)  # (B, 10), row-major triu
    torch.testing.assert_close(DotInteraction(5, 4)(x), explicit)
    torch.testing.assert_close(fm_pairwise(x), explicit.sum(1))


def test_lcb_and_cross_net() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 4)
    lcb = LinearCompressBlock(5, 3, 4)
    torch.testing.assert_close(lcb(x), torch.einsum("on,bnd->bod", lcb.weight, x))

    cross = CrossNet(6, num_layers=2)
    x0 = torch.randn(3, 6)
    x1 = x0 * cross.layers[0](x0) + x0
    torch.testing.assert_close(cross(x0), x0 * cross.layers[1](x1) + x1)


def test_cin_matches_definition() -> None:
    torch.manual_seed(0)
    x0 = torch.randn(2, 3, 4)
    cin = CIN(num_fields=3, dim=4, layer_sizes=[4, 2], split_half=True)
    assert cin.out_features == 2 + 2
    # Layer 1: X1_h = Σ_ij W_hij (X0_i ∘ X0_j); half goes on, half is pooled.
    w1, b1 = cin.convs[0].weight.squeeze(-1).view(4, 3, 3), cin.convs[0].bias
    x1 = torch.einsum("hij,bid,bjd->bhd", w1, x0, x0) + b1[:, None]
    w2, b2 = cin.convs[1].weight.squeeze(-1).view(2, 2, 3), cin.convs[1].bias
    x2 = torch.einsum("hij,bid,bjd->bhd", w2, x1[:, :2], x0) + b2[:, None]
    torch.testing.assert_close(cin(x0), torch.cat([x1[:, 2:].sum(-1), x2.sum(-1)], dim=1))
    with pytest.raises(ValueError, match="even"):
        CIN(3, 4, [5, 2])


def test_self_attention_is_permutation_equivariant() -> None:
    torch.manual_seed(0)
    att = MultiHeadSelfAttention(n=5, in_dim=4, heads=2, head_dim=3)
    x = torch.randn(2, 5, 4)
    perm = torch.tensor([3, 0, 4, 1, 2])
    assert att(x).shape == (2, 5, 6)
    torch.testing.assert_close(att(x[:, perm]), att(x)[:, perm])


# --- embedding layer ----------------------------------------------------------------------------

FEATURES = FeatureSet(
    sparse=(
        SparseInput("a", 10),
        SparseInput("bag", 12, pooling="mean", weighted=True),
        SparseInput("s1", 5),
        SparseInput("s2", 5),
        SparseInput("s3", 5),
    ),
    num_dense=2,
)


def table(layer: EmbeddingLayer, feature: str) -> Tensor:
    return layer.ebc.embedding_bags[f"t_{feature}"].weight


def test_embedding_layer_layout_and_pooling() -> None:
    torch.manual_seed(0)
    cfg = EmbeddingConfig(
        dim=8,
        init_std=0.1,
        dense_embeddings=2,
        multi_embedding={"a": 3},
        small_dim_features=["s1", "s2", "s3"],
    )
    layer = EmbeddingLayer(FEATURES, cfg)
    # 2 dense + 3 for "a" + 1 for "bag" + ceil(3 * 4 / 8) = 2 for the small-dim group
    assert (layer.num_outputs, layer.dim, layer.num_dense_outputs) == (8, 8, 2)
    assert layer.positions == {"a": [2, 3, 4], "bag": [5]}
    keys = ["bag", "s3", "a", "s1", "s2"]  # KJT key order need not match the tables'
    lengths = torch.tensor([2, 0, 1, 1, 1, 1, 1, 1, 1, 1])  # bag: rows of 2 and 0 ids
    values = torch.tensor([3, 7, 1, 2, 4, 9, 0, 3, 2, 2])
    weights = torch.tensor([0.5, 1.5, 1, 1, 1, 1, 1, 1, 1, 1])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights)
    x0 = layer(torch.randn(2, 2), kjt)
    assert x0.shape == (2, 8, 8)
    torch.testing.assert_close(x0[:, 2:5], table(layer, "a")[[4, 9]].view(2, 3, 8))
    weighted_mean = (0.5 * table(layer, "bag")[3] + 1.5 * table(layer, "bag")[7]) / 2.0
    torch.testing.assert_close(x0[0, 5], weighted_mean)
    torch.testing.assert_close(x0[1, 5], torch.zeros(8))  # empty bag
    small = torch.cat([table(layer, "s1")[[0, 3]], table(layer, "s2")[[2, 2]], table(layer, "s3")[[1, 2]]], 1)
    torch.testing.assert_close(x0[:, 6:].flatten(1), layer.small_mlp(small))
    with pytest.raises(ValueError, match="no weights"):
        layer(torch.randn(2, 2), KeyedJaggedTensor.from_lengths_sync(keys, values, lengths))


def test_unweighted_mean_pooling() -> None:
    features = FeatureSet(sparse=(SparseInput("a", 10, pooling="mean"), SparseInput("b", 10)), num_dense=0)
    layer = EmbeddingLayer(features, EmbeddingConfig(dim=4, init_std=0.1))
    assert layer.num_outputs == 2 and layer.dense_mlp is None
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["a", "b"], torch.tensor([1, 2, 3, 4, 5]), torch.tensor([3, 0, 1, 1])
    )
    x0 = layer(torch.empty(2, 0), kjt)
    torch.testing.assert_close(x0[:, 0], torch.stack([table(layer, "a")[[1, 2, 3]].mean(0), torch.zeros(4)]))
    torch.testing.assert_close(x0[:, 1], table(layer, "b")[[4, 5]])


@pytest.mark.parametrize("op", ["mult", "add"])
def test_quotient_remainder_embeddings(op: str) -> None:
    """A QR feature's vector is its quotient row times (plus) its remainder row, in the feature's place in
    X0; a bag mean-pools each half first; the tables hold ceil(N/m) + m rows instead of N."""
    torch.manual_seed(0)
    cfg = EmbeddingConfig(
        dim=8, init_std=0.1, qr_buckets={"a": 4, "bag": 5}, qr_op=op, multi_embedding={"s1": 2}
    )
    layer = EmbeddingLayer(FEATURES, cfg)
    rows = {c.name: c.num_embeddings for c in layer.ebc.embedding_bag_configs()}
    assert (rows["t_a#q"], rows["t_a#r"], rows["t_bag#q"], rows["t_bag#r"]) == (3, 4, 3, 5)
    assert layer.positions == {"a": [1], "bag": [2], "s1": [3, 4], "s2": [5], "s3": [6]}
    keys = ["a", "bag", "s1", "s2", "s3"]
    lengths = torch.tensor([1, 1, 2, 0, 1, 1, 1, 1, 1, 1])
    values = torch.tensor([9, 2, 11, 4, 3, 0, 1, 2, 4, 0])
    weights = torch.tensor([1.0, 1.0, 0.5, 1.5, 1, 1, 1, 1, 1, 1])
    x0 = layer(torch.randn(2, 2), KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights))
    assert x0.shape == (2, 7, 8)
    combine = (lambda q, r: q * r) if op == "mult" else (lambda q, r: q + r)
    q, r = table(layer, "a#q"), table(layer, "a#r")
    torch.testing.assert_close(x0[:, 1], combine(q[[9 // 4, 2 // 4]], r[[9 % 4, 2 % 4]]))
    q, r = table(layer, "bag#q"), table(layer, "bag#r")
    bag_q, bag_r = (0.5 * q[11 // 5] + 1.5 * q[4 // 5]) / 2, (0.5 * r[11 % 5] + 1.5 * r[4 % 5]) / 2
    torch.testing.assert_close(x0[0, 2], combine(bag_q, bag_r))
    torch.testing.assert_close(x0[1, 2], torch.zeros(8))  # empty bag
    torch.testing.assert_close(x0[:, 3:5], table(layer, "s1")[[3, 0]].view(2, 2, 8))
    torch.testing.assert_close(x0[:, 5], table(layer, "s2")[[1, 2]])
    if op == "mult":  # remainder rows start near 1, so a product starts near its quotient row
        assert (table(layer, "a#r").mean() - 1).abs() < 0.1


def test_a_feature_named_like_a_qr_half_is_a_plain_feature() -> None:
    """QR tables were found by their names' suffix: a feature called 'x#r' started its table near 1 (a
    remainder's init) without any qr_buckets (a CSV column 'a#r' trained other numbers than one called 'a',
    in the degenerate-data hunt), and one called 'x#q' was combined with the next feature's vector, which
    was then dropped, once another feature had qr_buckets."""
    torch.manual_seed(0)
    features = FeatureSet(
        sparse=(SparseInput("x#r", 10), SparseInput("x#q", 10), SparseInput("y", 10), SparseInput("a", 9)),
        num_dense=0,
    )
    layer = EmbeddingLayer(features, EmbeddingConfig(dim=4, init_std=0.1, qr_buckets={"a": 3}))
    assert table(layer, "x#r").mean().abs() < 0.1 and (table(layer, "a#r").mean() - 1).abs() < 0.1
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["x#r", "x#q", "y", "a"], torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), torch.ones(8, dtype=torch.int32)
    )
    x0 = layer(torch.empty(2, 0), kjt)
    assert x0.shape == (2, 4, 4)
    torch.testing.assert_close(x0[:, 0], table(layer, "x#r")[[1, 2]])
    torch.testing.assert_close(x0[:, 1], table(layer, "x#q")[[3, 4]])
    torch.testing.assert_close(x0[:, 2], table(layer, "y")[[5, 6]])
    torch.testing.assert_close(
        x0[:, 3], table(layer, "a#q")[[7 // 3, 8 // 3]] * table(layer, "a#r")[[7 % 3, 8 % 3]]
    )


def test_dense_features_no_layer_reads_are_refused() -> None:
    """dense_embeddings=0 with dense features in the data: they were read, preprocessed and never used (a run
    trained on the sparse features alone without a word; the degenerate-data hunt). The converse, dense
    embeddings without dense features, was refused already."""
    with pytest.raises(ValueError, match="dense_embeddings=0 but the feature set has 2 dense features"):
        EmbeddingLayer(
            FeatureSet(sparse=(SparseInput("a", 10),), num_dense=2), EmbeddingConfig(dense_embeddings=0)
        )
    EmbeddingLayer(
        FeatureSet(sparse=(SparseInput("a", 10),), num_dense=0), EmbeddingConfig(dense_embeddings=0)
    )
    EmbeddingLayer(
        FeatureSet(sparse=(SparseInput("a", 10),), num_dense=2), EmbeddingConfig(dense_embeddings=1)
    )


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"qr_buckets": {"a": 1}}, ">= 2"),
        ({"qr_buckets": {"a": 2}, "multi_embedding": {"a": 2}}, "both qr_buckets and multi_embedding"),
        ({"qr_buckets": {"nope": 2}}, "qr_buckets names unknown"),
        ({"dim": 10}, "multiples of 4"),
        ({"small_dim": 6}, "multiples of 4"),
        ({"multi_embedding": {"a": 0}}, ">= 1"),
        ({"multi_embedding": {"nope": 2}}, "unknown sparse features"),
        ({"small_dim_features": ["a"], "multi_embedding": {"a": 2}}, "both"),
        ({"dense_embeddings": 1}, "no dense features"),
    ],
)
def test_embedding_config_errors(cfg: dict, match: str) -> None:
    features = FeatureSet(sparse=(SparseInput("a", 10),), num_dense=0)
    with pytest.raises(ValueError, match=match):  # pydantic's ValidationError is a ValueError
        EmbeddingLayer(features, EmbeddingConfig(**cfg))
    with pytest.raises(ValidationError):
        EmbeddingConfig(unknown_key=1)


def test_a_feature_named_as_another_features_extra_table_is_refused() -> None:
    """A feature 's0#q' beside a QR feature 's0' failed with "Duplicate table name t_s0#q" (no fix
    hint); likewise a sequence 'item#seq' beside the table the sequences of 'item' share. Both are now
    refused naming the two features and the fix."""
    with pytest.raises(
        ValueError, match=r"sparse features 's0' and 's0#q' clash: .*qr_buckets gives 's0'; rename one"
    ):
        EmbeddingLayer(
            FeatureSet(sparse=(SparseInput("s0", 10), SparseInput("s0#q", 10)), num_dense=0),
            EmbeddingConfig(dim=4, qr_buckets={"s0": 3}),
        )
    shared = (SparseInput("item", 20), SparseInput("h", 20, "mean", False, 6, vocabulary="item"))
    with pytest.raises(ValueError, match=r"sparse features 'item' and 'item#seq' clash: .* rename one"):
        EmbeddingLayer(
            FeatureSet(sparse=(*shared, SparseInput("item#seq", 20, "mean", False, 6)), num_dense=0),
            EmbeddingConfig(dim=4),
        )
    # Without qr_buckets (or beside a pooled 'item#seq', another collection's table) the names are free.
    EmbeddingLayer(
        FeatureSet(sparse=(SparseInput("s0", 10), SparseInput("s0#q", 10)), num_dense=0),
        EmbeddingConfig(dim=4),
    )
    EmbeddingLayer(
        FeatureSet(sparse=(*shared, SparseInput("item#seq", 20)), num_dense=0), EmbeddingConfig(dim=4)
    )
