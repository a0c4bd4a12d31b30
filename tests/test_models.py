"""Every registered model: shapes, gradients, determinism, learning planted interactions, DMP."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
import torchrec
from pydantic import ValidationError
from torch import Tensor, nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recscale.distributed.env import init_distributed
from recscale.models import EmbeddingConfig, FeatureSet, SparseInput, build_model, model_names, params_class
from recscale.models.lr import LRParams

# Single-id, multi-id sum, multi-id mean, and a feature whose table is split into 2 vectors.
FEATURES = FeatureSet(
    sparse=(
        SparseInput("user", 50),
        SparseInput("item", 40),
        SparseInput("tags", 30, pooling="mean"),
        SparseInput("hist", 20),
        SparseInput("city", 6),
    ),
    num_dense=3,
)
MULTI_ID = {"tags", "hist"}
# The same features with the multi-id ones weighted.
WEIGHTED = FeatureSet(
    sparse=tuple(replace(f, weighted=f.name in MULTI_ID) for f in FEATURES.sparse),
    num_dense=FEATURES.num_dense,
)
EMBEDDING = EmbeddingConfig(
    dim=8, init_std=0.05, dense_hidden=[8], multi_embedding={"item": 2}, small_dim_features=["city"]
)


@pytest.fixture(autouse=True, scope="module")
def single_thread() -> Iterator[None]:
    """These tiny ops gain nothing from intra-op threads and slow down a lot on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Small hyperparameters per model, and variants that exercise each structural option.
SMALL: dict[str, dict[str, Any]] = {
    "lr": {},
    "fm": {},
    "wukong": {"num_layers": 2, "n_f": 4, "n_l": 3, "k": 3, "fmb_mlp": [16], "final_mlp": [16]},
    "dlrm": {"top_mlp": [16, 8]},
    "dcnv2": {"num_cross_layers": 2, "mlp": [16]},
    "dhen": {"num_layers": 2, "num_embeddings": 5, "final_mlp": [16]},
    "finalmlp": {"mlp1": [16, 16], "mlp2": [8], "fs_hidden": [8], "fusion_heads": 2},
    "masknet": {"num_blocks": 2, "block_dim": 16, "mlp": [16]},
    "autoint": {"attention_layers": 2, "heads": 2, "head_dim": 4, "mlp": [16]},
    "xdeepfm": {"cin_layers": [6, 4], "mlp": [16]},
}
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    *SMALL.items(),
    # The full FM takes no k.
    (
        "wukong",
        {
            **{key: v for key, v in SMALL["wukong"].items() if key != "k"},
            "fm": "full",
            "n_f": 5,
            "n_l": 5,
            "norm": "batch",
            "dropout": 0.1,
        },
    ),  # fmt: skip
    ("dlrm", {**SMALL["dlrm"], "interaction": "cat", "norm": "batch", "dropout": 0.1}),
    ("dcnv2", {**SMALL["dcnv2"], "structure": "stacked", "low_rank": 4, "norm": "batch"}),
    (
        "dhen",
        {**SMALL["dhen"], "modules": ["dot", "cross", "self_attention", "linear", "mlp"], "module_mlp": [16]},
    ),
    ("finalmlp", {**SMALL["finalmlp"], "fs1_context": ["user"], "fs2_context": ["item", "tags"]}),
    ("masknet", {**SMALL["masknet"], "mode": "serial", "norm": "layer"}),
    ("autoint", {**SMALL["autoint"], "mlp": []}),
    ("xdeepfm", {**SMALL["xdeepfm"], "split_half": False}),
]
VARIANT_IDS = [f"{name}-{i}" for i, (name, _) in enumerate(VARIANTS)]


def random_batch(
    features: FeatureSet, batch_size: int, gen: torch.Generator
) -> tuple[Tensor, KeyedJaggedTensor]:
    """Dense (B, num_dense) and a KJT: 1 id per row for single-id features, 0-3 ids for MULTI_ID ones,
    weights (1.0 for unweighted features) when any feature is weighted."""
    lengths, values, weights = [], [], []
    for f in features.sparse:
        if f.name in MULTI_ID:
            n = torch.randint(0, 4, (batch_size,), generator=gen)
        else:
            n = torch.ones(batch_size, dtype=torch.long)
        ids = torch.randint(0, f.num_embeddings, (int(n.sum()),), generator=gen)
        lengths.append(n)
        values.append(ids)
        weights.append(torch.rand(len(ids), generator=gen) + 0.5 if f.weighted else torch.ones(len(ids)))
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f.name for f in features.sparse],
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        weights=torch.cat(weights) if any(f.weighted for f in features.sparse) else None,
    )
    return torch.randn(batch_size, features.num_dense, generator=gen), kjt


def build(name: str, params: dict[str, Any], features: FeatureSet = FEATURES, **kw: Any) -> nn.Module:
    return build_model(name, features, kw.pop("embedding", EMBEDDING), params, **kw)


def test_registry() -> None:
    names = model_names()
    assert names == sorted(SMALL)
    for name in names:
        assert params_class(name)() == params_class(name).model_validate({})  # all fields have defaults
    with pytest.raises(ValueError, match="known models: autoint, dcnv2"):
        build_model("nope", FEATURES, EMBEDDING, {})
    with pytest.raises(ValidationError):
        build("wukong", {"n_layers": 3})
    with pytest.raises(ValueError, match="takes WukongParams"):
        build("wukong", LRParams())


@pytest.mark.parametrize("name", sorted(SMALL))
def test_default_params_build(name: str) -> None:
    model = build_model(name, FEATURES, EmbeddingConfig(), {})
    dense, sparse = random_batch(FEATURES, 4, torch.Generator().manual_seed(0))
    assert model(dense, sparse).shape == (4,)
    assert model.flops_per_example() > 0


@pytest.mark.parametrize(("name", "params"), VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("features", [FEATURES, WEIGHTED], ids=["unweighted", "weighted"])
def test_forward_backward(name: str, params: dict[str, Any], features: FeatureSet) -> None:
    torch.manual_seed(0)
    model = build(name, params, features)
    assert model.embedding.num_outputs == 7  # 1 dense + user + 2 item + tags + hist + 1 for small-dim city
    dense, sparse = random_batch(features, 8, torch.Generator().manual_seed(1))
    logits = model(dense, sparse)
    assert logits.shape == (8,) and logits.dtype == torch.float32
    nn.functional.binary_cross_entropy_with_logits(logits, torch.rand(8).round()).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{pname} is unused"
        assert torch.isfinite(p.grad).all(), pname
    zero_grad = {pname for pname, p in model.named_parameters() if not p.grad.any()}
    # FinalMLP's shared gate context starts at 0 (as in the authors' code): no gradient for the weight
    # it multiplies until the context has moved.
    shared_context = {
        f"gates.{i}.gate.0.weight" for i, g in enumerate(getattr(model, "gates", [])) if not g.context
    }
    assert zero_grad == shared_context


@pytest.mark.parametrize("name", sorted(SMALL))
def test_inputs_as_a_python_caller_gives_them(name: str) -> None:
    """float64 dense features (numpy's default), int32 ids and lengths, a batch of one, empty bags: the
    same logits as float32 dense and int64 ids (a float64 batch was a torch dtype error)."""
    model = build(name, SMALL[name]).eval()
    dense, sparse = random_batch(FEATURES, 5, torch.Generator().manual_seed(3))
    assert (sparse.lengths() == 0).any()  # some rows have an empty bag of tags or hist
    expected = model(dense, sparse)
    int32 = KeyedJaggedTensor(
        keys=sparse.keys(), values=sparse.values().int(), lengths=sparse.lengths().int()
    )
    torch.testing.assert_close(model(dense.double(), int32), expected)
    keys = sparse.keys()  # one row, every bag empty
    empty = KeyedJaggedTensor(
        keys=keys, values=sparse.values()[:0], lengths=torch.zeros(len(keys), dtype=torch.long)
    )
    assert model(dense[:1], empty).shape == (1,)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_deterministic(name: str) -> None:
    def run() -> tuple[Tensor, dict[str, Tensor]]:
        torch.manual_seed(123)
        params = dict(SMALL[name])
        if "dropout" in params_class(name).model_fields:
            params["dropout"] = 0.2  # dropout masks come from the seeded global RNG too
        model = build(name, params)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(7)
        for _ in range(3):
            dense, sparse = random_batch(FEATURES, 16, gen)
            loss = nn.functional.binary_cross_entropy_with_logits(model(dense, sparse), torch.ones(16))
            opt.zero_grad()
            loss.backward()
            opt.step()
        return model(dense, sparse), {k: v.clone() for k, v in model.state_dict().items()}

    (out1, state1), (out2, state2) = run(), run()
    assert torch.equal(out1, out2)
    assert state1.keys() == state2.keys()
    assert all(torch.equal(state1[k], state2[k]) for k in state1)


# --- learning planted interactions ------------------------------------------------------------

PLANTED_VOCAB = 8
# No dense features: an O(1) dense embedding of pure noise next to O(init_std) sparse ones slows the
# escape from the initial plateau for several models, which only makes this test slower.
PLANTED = FeatureSet(sparse=tuple(SparseInput(f"f{i}", PLANTED_VOCAB + 1) for i in range(6)), num_dense=0)


def planted_data(n: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """ids (n, 6) in 1..V, empty dense (n, 0), labels (n,) ~ Bernoulli(σ(logit)) where the logit is two
    pairwise terms (f0,f1), (f2,f3) and a triple (f1,f3,f4) term, all with zero main effects, so LR
    learns nothing; f5 is noise."""
    table_gen = torch.Generator().manual_seed(99)

    def centered(*shape: int) -> Tensor:
        t = torch.randn(*shape, generator=table_gen)
        for axis in range(len(shape)):
            t = t - t.mean(axis, keepdim=True)
        return t / t.std()

    p01, p23 = centered(PLANTED_VOCAB, PLANTED_VOCAB), centered(PLANTED_VOCAB, PLANTED_VOCAB)
    sign = torch.tensor([1.0, -1.0]).repeat(PLANTED_VOCAB // 2)
    x = torch.randint(0, PLANTED_VOCAB, (n, 6), generator=gen)
    logit = (
        1.5 * (p01[x[:, 0], x[:, 1]] + p23[x[:, 2], x[:, 3]])
        + 1.5 * sign[x[:, 1]] * sign[x[:, 3]] * sign[x[:, 4]]
    )
    labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)
    return x + 1, torch.empty(n, 0), labels


def to_kjt(ids: Tensor) -> KeyedJaggedTensor:
    """(B, F) single ids -> KJT keyed f0..f{F-1}."""
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f.name for f in PLANTED.sparse],
        values=ids.T.reshape(-1),
        lengths=torch.ones(ids.numel(), dtype=torch.long),
    )


def auc(scores: Tensor, labels: Tensor) -> float:
    """ROC AUC by the rank-sum formula (ties have probability ~0 for float scores)."""
    ranks = torch.empty_like(scores)
    ranks[scores.argsort()] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


@pytest.fixture(scope="module")
def planted_aucs() -> dict[str, float]:
    """Validation AUC of every model after 300 Adam steps of 256 examples on planted data."""
    steps, batch = 300, 256
    ids, dense, labels = planted_data(steps * batch + 4000, torch.Generator().manual_seed(0))
    split = steps * batch
    val_dense, val_sparse, val_labels = dense[split:], to_kjt(ids[split:]), labels[split:]
    aucs = {}
    for name in model_names():
        torch.manual_seed(0)
        model = build_model(name, PLANTED, EmbeddingConfig(dim=8, init_std=0.01), SMALL[name])
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for i in range(0, split, batch):
            logits = model(dense[i : i + batch], to_kjt(ids[i : i + batch]))
            loss = nn.functional.binary_cross_entropy_with_logits(logits, labels[i : i + batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            aucs[name] = auc(model(val_dense, val_sparse), val_labels)
    return aucs


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in sorted(SMALL) if n != "lr"])
def test_learns_planted_interactions(name: str, planted_aucs: dict[str, float]) -> None:
    assert planted_aucs["lr"] < 0.6, planted_aucs
    assert planted_aucs[name] > planted_aucs["lr"] + 0.1, planted_aucs


# --- DistributedModelParallel -----------------------------------------------------------------


def test_distributed_model_parallel() -> None:
    """Each model built on meta is materialised and sharded by DMP (gloo, world size 1) and trains."""
    init_distributed()  # a group of one; reused if an earlier test started it
    dense, sparse = random_batch(WEIGHTED, 8, torch.Generator().manual_seed(0))
    for name in model_names():
        model = build_model(name, WEIGHTED, EMBEDDING, SMALL[name], device=torch.device("meta"))
        assert all(p.is_meta for p in model.parameters())
        torchrec.optim.apply_optimizer_in_backward(
            torchrec.optim.RowWiseAdagrad, model.embedding.ebc.parameters(), {"lr": 0.05}
        )
        dmp = DistributedModelParallel(model, device=torch.device("cpu"))
        assert not isinstance(dmp.module.embedding.ebc, torchrec.EmbeddingBagCollection)  # sharded
        logits = dmp(dense, sparse)
        assert logits.shape == (8,) and torch.isfinite(logits).all()
        logits.sum().backward()
        dense_params = [p for n, p in dmp.named_parameters() if "ebc" not in n]
        assert dense_params and all(torch.isfinite(p).all() for p in dense_params), name
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in dense_params), name


def test_dlrm_warns_when_dot_products_cannot_learn() -> None:
    """No dense features and a tiny init_std: every top-MLP input starts at ~1e-8 (AUC 0.5 on Frappe)."""
    sparse_only = FeatureSet(sparse=FEATURES.sparse, num_dense=0)
    with pytest.warns(UserWarning, match="model.embedding.init_std=0.05"):
        build("dlrm", SMALL["dlrm"], sparse_only, embedding=EmbeddingConfig(dim=8))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build("dlrm", SMALL["dlrm"], sparse_only, embedding=EmbeddingConfig(dim=8, init_std=0.05))
        build("dlrm", SMALL["dlrm"], embedding=EmbeddingConfig(dim=8))  # dense features carry the signal


def test_dlrm_dot_interaction_over_one_embedding_is_refused() -> None:
    """One sparse feature and no dense: no pair to take a product of, so the top MLP had 0 inputs and the
    model trained to a constant (valid AUC 0.5000, exit 0) in the degenerate-data hunt."""
    one = FeatureSet(sparse=(SparseInput("user", 50),), num_dense=0)
    embedding = EmbeddingConfig(dim=8, init_std=0.05)
    with pytest.raises(ValueError, match="set model.interaction=cat or add features"):
        build("dlrm", SMALL["dlrm"], one, embedding=embedding)
    build("dlrm", {**SMALL["dlrm"], "interaction": "cat"}, one, embedding=embedding)
    build("dlrm", SMALL["dlrm"], FeatureSet(sparse=one.sparse, num_dense=1), embedding=embedding)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("wukong", "fmb_mlp"),
        ("wukong", "final_mlp"),
        ("dlrm", "top_mlp"),
        ("dcnv2", "mlp"),
        ("dhen", "module_mlp"),
        ("dhen", "final_mlp"),
        ("finalmlp", "mlp1"),
        ("finalmlp", "mlp2"),
        ("finalmlp", "fs_hidden"),
        ("masknet", "mlp"),
        ("autoint", "mlp"),
        ("xdeepfm", "mlp"),
        ("xdeepfm", "cin_layers"),
    ],
)
@pytest.mark.parametrize("width", [0, -1])
def test_layer_widths_below_one_are_config_errors(name: str, key: str, width: int) -> None:
    # A 0-wide layer trained a model with a constant output; a negative one was a torch error.
    with pytest.raises(ValidationError, match=f"{key}.0\n.*greater than or equal to 1"):
        params_class(name).model_validate({key: [width]})


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("masknet", {"block_dim": 1}, "give block_dim 2 or more"),
        ("dlrm", {"top_mlp": [16, 1], "norm": "layer"}, "choose another model.norm"),
        ("wukong", {"final_mlp": [1], "norm": "layer"}, "choose another model.norm"),
    ],
)
def test_layer_norm_over_one_unit_is_refused(name: str, params: dict[str, Any], match: str) -> None:
    """LayerNorm of a width-1 layer outputs its bias whatever the input: MaskNet with block_dim 1, and DLRM
    with top_mlp [1] and norm=layer, trained a constant (valid AUC 0.5000, exit 0) in the degenerate-data hunt."""
    with pytest.raises((ValueError, ValidationError), match=match):
        build(name, {**SMALL[name], **params})
    build(
        name,
        {**SMALL[name], **params, "norm": "none"} if "norm" in params else {**SMALL[name], "block_dim": 2},
    )


def test_xdeepfm_needs_a_cin_layer() -> None:
    with pytest.raises(ValidationError, match="cin_layers"):  # it was torch.cat() of no tensors mid-forward
        params_class("xdeepfm").model_validate({"cin_layers": []})


def test_din_attention_widths_below_one_are_config_errors() -> None:
    from recscale.models.blocks.sequence import SequenceConfig

    with pytest.raises(ValidationError, match="attention_hidden.0"):
        SequenceConfig.model_validate({"attention_hidden": [0]})


# --- each model's interaction against its paper's equations -------------------------------------


def _ln(x: Tensor, norm: nn.LayerNorm) -> Tensor:
    """LayerNorm over the last axis, written out."""
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / (var + norm.eps).sqrt() * norm.weight + norm.bias


def _pairs(x: Tensor) -> Tensor:
    """(B, n, d) -> (B, n(n-1)/2): <x_i, x_j> for i < j, row-major."""
    n = x.shape[1]
    return torch.stack([(x[:, i] * x[:, j]).sum(-1) for i in range(n) for j in range(i + 1, n)], dim=1)


def _mix(weight: Tensor, x: Tensor) -> Tensor:
    """W X along the embedding axis (Wukong's LCB): (o, n), (B, n, d) -> (B, o, d)."""
    return torch.einsum("on,bnd->bod", weight, x)


def _wukong(m: nn.Module, x: Tensor) -> Tensor:
    # X_{i+1} = LN(concat(FMB(X_i), LCB(X_i)) + X_i), FMB(X) = MLP(LN(flatten(X Xᵀ Y))) (Zhang et al. 2024).
    for layer in m.layers:
        fm = x @ x.transpose(1, 2) @ layer.fmb.fm.y
        fmb = layer.fmb.mlp(_ln(fm.flatten(1), layer.fmb.norm)).view(x.shape[0], -1, x.shape[2])
        res = x if isinstance(layer.residual, nn.Identity) else _mix(layer.residual.weight, x)
        x = _ln(torch.cat([fmb, _mix(layer.lcb.weight, x)], dim=1) + res, layer.norm)
    return m.head(x.flatten(1))[:, 0]


def _dlrm(m: nn.Module, x: Tensor) -> Tensor:
    # top_mlp([processed dense, dot products of all distinct pairs]) (Naumov et al. 2019).
    return m.top_mlp(torch.cat([x[:, 0], _pairs(x)], dim=1))[:, 0]


def _cross(layers: nn.ModuleList, x0: Tensor) -> Tensor:
    # x_{l+1} = x_0 ⊙ (U_l V_lᵀ x_l + b_l) + x_l (Wang et al. 2021, low rank).
    x = x0
    for down, up in layers:
        x = x0 * (x @ down.weight.T @ up.weight.T + up.bias) + x
    return x


def _dcnv2(m: nn.Module, x: Tensor) -> Tensor:
    return m.out(m.deep(_cross(m.cross.layers, x.flatten(1))))[:, 0]  # stacked


def _finalmlp(m: nn.Module, x: Tensor) -> Tensor:
    # o_s = MLP_s(E ⊙ 2σ(gate_s(context_s))); Σ_h BF(o_1h, o_2h) (Mao et al. 2023).
    o = [
        mlp(x.flatten(1) * 2 * torch.sigmoid(gate.gate(x[:, gate.context].flatten(1))))
        for gate, mlp in zip(m.gates, m.streams, strict=True)
    ]
    f, heads = m.fusion, m.fusion.heads
    o1, o2 = (t.view(t.shape[0], heads, -1) for t in o)
    bilinear = sum(torch.einsum("bi,ij,bj->b", o1[:, h], f.w_xy[h], o2[:, h]) for h in range(heads))
    return f.w_x(o[0])[:, 0] + f.w_y(o[1])[:, 0] + bilinear


def _autoint(m: nn.Module, x: Tensor) -> Tensor:
    # e_m = ReLU(⊕_h Σ_k softmax_k(<W_q^h e_m, W_k^h e_k>) W_v^h e_k + W_res e_m) (Song et al. 2019), + DNN.
    h = x
    for att in m.attention:
        wq, wk, wv = att.qkv.weight.chunk(3)
        heads = []
        for s in range(att.heads):
            rows = slice(s * att.head_dim, (s + 1) * att.head_dim)
            q, k, v = h @ wq[rows].T, h @ wk[rows].T, h @ wv[rows].T
            heads.append(torch.softmax(q @ k.transpose(1, 2), dim=-1) @ v)
        h = torch.relu(torch.cat(heads, dim=-1) + h @ att.residual.weight.T)
    return m.attention_out(h.flatten(1))[:, 0] + m.dnn(x.flatten(1))[:, 0]


def _masknet(m: nn.Module, x: Tensor) -> Tensor:
    # MaskBlock: ReLU(LN(W (mask(V_emb) ⊙ V_in))), V_in = LN_EMB(X0) per field (Wang et al. 2021), parallel.
    v_emb, v_in = x.flatten(1), _ln(x, m.emb_norm).flatten(1)
    outs = []
    for block in m.blocks:
        linear, norm = block.hidden[0], block.hidden[1]
        outs.append(torch.relu(_ln(linear(block.mask(v_emb) * v_in), norm)))
    return m.head(torch.cat(outs, dim=1))[:, 0]


def _xdeepfm(m: nn.Module, x0: Tensor) -> Tensor:
    # CIN: X^k_h = Σ_ij W^{k,h}_ij (X^{k-1}_i ∘ X^0_j), sum-pooled over d; half on, half out (Lian et al. 2018).
    xk, pooled = x0, []
    for conv, half in zip(m.cin.convs, m.cin.halves, strict=True):
        w = conv.weight[..., 0].view(conv.out_channels, xk.shape[1], x0.shape[1])
        z = torch.einsum("hij,bid,bjd->bhd", w, xk, x0) + conv.bias[:, None]
        xk, out = z.chunk(2, dim=1) if half else (z, z)
        pooled.append(out.sum(-1))
    flat = x0.flatten(1)
    return (m.linear(flat) + m.cin_out(torch.cat(pooled, dim=1)) + m.dnn(flat))[:, 0]


def _fm(m: nn.Module, x: Tensor) -> Tensor:
    return m.linear(x.flatten(1))[:, 0] + _pairs(x).sum(1)  # w·x + Σ_{i<j} <v_i, v_j> (Rendle 2010)


PAPER_FORMS: list[tuple[str, dict[str, Any], Callable[[Any, Tensor], Tensor]]] = [
    ("wukong", {**SMALL["wukong"], "n_f": 2}, _wukong),  # a projected residual, then the identity
    ("dlrm", SMALL["dlrm"], _dlrm),
    ("dcnv2", {**SMALL["dcnv2"], "structure": "stacked", "low_rank": 3}, _dcnv2),
    ("finalmlp", {**SMALL["finalmlp"], "fs1_context": ["user"], "fs2_context": ["item", "tags"]}, _finalmlp),
    ("autoint", SMALL["autoint"], _autoint),
    ("masknet", SMALL["masknet"], _masknet),
    ("xdeepfm", SMALL["xdeepfm"], _xdeepfm),
    ("fm", SMALL["fm"], _fm),
]


@pytest.mark.parametrize(("name", "params", "reference"), PAPER_FORMS, ids=[p[0] for p in PAPER_FORMS])
def test_interaction_is_the_papers_equation(
    name: str, params: dict[str, Any], reference: Callable[[Any, Tensor], Tensor]
) -> None:
    """Each model's X0 -> logit against its paper's equations written out with the model's own weights."""
    torch.manual_seed(0)
    model = build(name, params).double().eval()
    x0 = torch.randn(3, model.embedding.num_outputs, model.embedding.dim, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model.interact(x0), reference(model, x0))
