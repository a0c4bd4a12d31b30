"""Model-based retrieval: item indexes, the seen-item Bloom filter, the two-tower model."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from recscale.errors import CheckpointError
from recscale.retrieval.bloom import BloomFilter
from recscale.retrieval.index import ExactIndex, Int8Index, ItemIndex, IVFIndex, recall
from recscale.retrieval.pipeline import IndexKind, Ranker, RetrievalSpec, RetrieveRank, make_index
from recscale.retrieval.synthetic import latent_data
from recscale.retrieval.two_tower import Tower, TwoTower, embed, fit
from recscale.serve.artifact import MANIFEST, WEIGHTS
from recscale.serve.retrieval_artifact import load_retrieval, save_retrieval


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, torch.Tensor]:
    d = latent_data(n_users=64, n_items=5000, dim=32, per_user=1, n_clusters=64)
    return d.items, d.users


def test_exact_index_is_brute_force_argsort(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    items, queries = data
    scores, ids = ExactIndex(items)(queries, 20)
    want = (queries @ items.T).argsort(dim=1, descending=True)[:, :20]
    assert torch.equal(ids, want)
    assert torch.allclose(scores, (queries @ items.T).gather(1, want))


def test_int8_index_recall_and_memory(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    items, queries = data
    _, exact = ExactIndex(items)(queries, 100)
    index = Int8Index(items)
    _, ids = index(queries, 100)
    assert recall(ids, exact) >= 0.95
    assert index.index_bytes() == items.shape[0] * (items.shape[1] + 4)
    assert ExactIndex(items).index_bytes() / index.index_bytes() >= 3


@pytest.mark.parametrize("int8", [False, True])
def test_ivf_all_lists_equals_exact(data: tuple[torch.Tensor, torch.Tensor], int8: bool) -> None:
    items, queries = data
    reference = Int8Index(items) if int8 else ExactIndex(items)
    want_scores, want = reference(queries, 50)
    scores, ids = IVFIndex(items, nlist=32, nprobe=32, int8=int8)(queries, 50)
    assert torch.equal(ids, want)
    assert torch.allclose(scores, want_scores, atol=1e-5)


def test_ivf_recall_grows_with_nprobe(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    items, queries = data
    _, exact = ExactIndex(items)(queries, 100)
    recalls = [recall(IVFIndex(items, nlist=64, nprobe=p)(queries, 100)[1], exact) for p in (1, 8, 64)]
    assert recalls[0] < recalls[1] < recalls[2] == 1.0


def test_bloom_filter_no_false_negatives_bounded_false_positives() -> None:
    gen = torch.Generator().manual_seed(0)
    bloom = BloomFilter.sized(capacity=20_000, fp_rate=0.01)
    users, items = (
        torch.randint(0, 1000, (20_000,), generator=gen),
        torch.randint(0, 50_000, (20_000,), generator=gen),
    )
    bloom.add(users, items)
    assert bloom.might_contain(users, items).all()
    others = bloom.might_contain(torch.randint(1000, 2000, (200_000,), generator=gen), items.repeat(10))
    fill = 1 - math.exp(-bloom.n_hashes * 20_000 / bloom.n_bits)
    assert others.float().mean().item() <= 2 * fill**bloom.n_hashes
    assert bloom.index_bytes() == math.ceil(bloom.n_bits / 8)


@pytest.mark.parametrize("make", [ExactIndex, Int8Index, lambda x: IVFIndex(x, nlist=16, nprobe=4)])
def test_seen_items_never_returned(
    data: tuple[torch.Tensor, torch.Tensor], make: Callable[[torch.Tensor], ItemIndex]
) -> None:
    items, queries = data
    index = make(items)
    users = torch.arange(queries.shape[0])
    _, first = index(queries, 10)
    bloom = BloomFilter.sized(capacity=first.numel(), fp_rate=0.01)
    bloom.add(users[:, None].expand_as(first), first)
    _, ids = index(queries, 10, users=users, seen=bloom)
    assert not bloom.might_contain(users[:, None].expand_as(ids), ids).any()
    assert all(not set(a.tolist()) & set(b.tolist()) for a, b in zip(ids, first, strict=True))


def _seen_by_brute_force(
    index: ItemIndex, queries: torch.Tensor, k: int, users: torch.Tensor, seen: BloomFilter, n_items: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every item ranked without the filter, the ones ``seen`` may hold dropped, the first k kept: the
    whole-row mask's result (scores distinct), -inf / -1 past a row's last unseen item."""
    scores, ids = index(queries, n_items)
    hit = seen.might_contain(users[:, None].expand_as(ids), ids.clamp_min(0)) | (ids < 0)
    order = hit.to(torch.uint8).argsort(dim=1, stable=True)[:, :k]
    drop = hit.gather(1, order)
    return scores.gather(1, order).masked_fill(drop, float("-inf")), ids.gather(1, order).masked_fill(
        drop, -1
    )


def _seen_many(queries: torch.Tensor, items: torch.Tensor, users: torch.Tensor) -> BloomFilter:
    """User u has seen its best ``3u`` items (part of a row's first window, or all of it), and 30 random
    others; the last 4 users every item."""
    gen = torch.Generator().manual_seed(1)
    best = (queries @ items.T).argsort(dim=1, descending=True)
    pairs = [(u, i) for u in users[:-4].tolist() for i in best[u, : 3 * u].tolist()]
    pairs += [(u, i) for u in users[-4:].tolist() for i in range(len(items))]
    pairs += [(u, int(i)) for u in users.tolist() for i in torch.randint(0, len(items), (30,), generator=gen)]
    seen = BloomFilter.sized(capacity=len(pairs), fp_rate=0.01)
    seen.add(*torch.tensor(pairs).T)
    return seen


@pytest.mark.parametrize(
    "make",
    [
        ExactIndex,
        Int8Index,
        lambda x: IVFIndex(x, nlist=16, nprobe=4),
        lambda x: IVFIndex(x, nlist=16, nprobe=16),
    ],
)
def test_seen_filter_tests_a_window_and_equals_masking_every_pair(
    data: tuple[torch.Tensor, torch.Tensor], make: Callable[[torch.Tensor], ItemIndex], monkeypatch
) -> None:
    """The filter hashed every (user, item) pair of the score matrix: 10^6 items took 38 s a batch, not 0.4 s.
    It now tests a window of each row's best items, widened, then the whole row, for the rows it leaves
    short: the same ids and scores as masking every pair, including rows with fewer than k unseen items."""
    from recscale.retrieval import index as index_module

    items, queries = data
    items = items[:1500]  # ~50 items a list: IVF with nprobe 4 has rows of fewer than 300 candidates
    index = make(items)
    users = torch.arange(queries.shape[0])
    seen = _seen_many(queries, items, users)
    hashed: list[int] = []
    might_contain = seen.might_contain
    monkeypatch.setattr(seen, "might_contain", lambda u, i: hashed.append(i.numel()) or might_contain(u, i))
    monkeypatch.setattr(index_module, "_MASK_PAIRS", 1000)  # the whole-row fallback, a block at a time
    for k in (1, 10, 300):
        want_scores, want = _seen_by_brute_force(index, queries, k, users, seen, len(items))
        hashed.clear()
        scores, ids = index(queries, k, users=users, seen=seen)
        assert torch.equal(ids, want)
        assert torch.allclose(scores, want_scores, rtol=0, atol=1e-6)
        assert (ids[-4:] == -1).all()  # the users who saw every item
        # A window of every row, then wider windows or whole rows for the rows where seen items crowd it
        # (except for IVF at nprobe 4 and k = 300: a window of 600 holds every item a row probes).
        assert hashed[0] == len(users) * (k + max(k, 64)) and (len(hashed) > 1 or k == 300)
        assert sum(hashed) < len(users) * len(items) / 2


def test_seen_filter_on_few_seen_items_hashes_one_window_a_row(
    data: tuple[torch.Tensor, torch.Tensor],
) -> None:
    items, queries = data
    users = torch.arange(queries.shape[0])
    seen = BloomFilter.sized(capacity=len(users) * 5, fp_rate=0.01)
    _, first = ExactIndex(items)(queries, 5)
    seen.add(users.repeat_interleave(5), first.flatten())
    hashed: list[int] = []
    might_contain = seen.might_contain
    seen.might_contain = lambda u, i: hashed.append(i.numel()) or might_contain(u, i)  # type: ignore[method-assign]
    _, ids = ExactIndex(items)(queries, 10, users=users, seen=seen)
    assert hashed == [len(users) * (10 + 64)]  # not every one of the 5,000 items of a row
    assert torch.equal(ids, _seen_by_brute_force(ExactIndex(items), queries, 10, users, seen, len(items))[1])


@pytest.mark.parametrize("n_items, nlist", [(500, 32), (20, 10)])  # cdist by matmul; directly (<= 25 rows)
def test_kmeans_assigns_a_chunk_of_rows_at_a_time_with_the_same_result(
    n_items: int, nlist: int, monkeypatch
) -> None:
    """k-means and the IVF build computed the whole (items, nlist) distance matrix at once: 4 GB at 10^6
    items and 1,024 lists. They now assign a chunk of rows at a time, with the same centroids and lists."""
    from recscale.retrieval import index as index_module

    items = latent_data(n_users=1, n_items=n_items, dim=16, per_user=1, n_clusters=8).items
    whole = IVFIndex(items, nlist=nlist, nprobe=2, iters=5)
    rows: list[int] = []
    cdist = torch.cdist
    monkeypatch.setattr(torch, "cdist", lambda x, y, **kw: rows.append(len(x)) or cdist(x, y, **kw))
    monkeypatch.setattr(index_module, "_ASSIGN_ROWS", 7, raising=False)
    chunked = IVFIndex(items, nlist=nlist, nprobe=2, iters=5)
    assert max(rows) == 7 and sum(rows) == 6 * n_items  # 5 iterations and the final assignment
    for name in ("centroids", "offsets", "ids", "rows"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name
    queries = torch.randn(5, 16)
    assert all(torch.equal(a, b) for a, b in zip(chunked(queries, 10), whole(queries, 10), strict=True))


@pytest.mark.parametrize("int8", [False, True])
def test_an_ivf_search_gathers_a_chunk_of_rows_at_a_time_with_the_same_result(
    int8: bool, monkeypatch
) -> None:
    """An IVF search gathered (int8: dequantized) the rows of every probed list at once, a (U, d) fp32 copy
    beside the (Q, U) scores: a chunk at a time now, as Int8Index scores, with the same results."""
    from recscale.retrieval import index as index_module

    items = latent_data(n_users=1, n_items=400, dim=16, per_user=1, n_clusters=8).items
    ivf = IVFIndex(items, nlist=16, nprobe=8, int8=int8, iters=3)
    queries = torch.randn(6, 16)
    whole = ivf(queries, 10)
    gathered: list[int] = []
    rows = IVFIndex._rows
    monkeypatch.setattr(IVFIndex, "_rows", lambda self, pos: gathered.append(len(pos)) or rows(self, pos))
    monkeypatch.setattr(index_module, "_CHUNK_ROWS", 7)
    chunked = ivf(queries, 10)
    assert max(gathered) == 7 and sum(gathered) > 100
    assert torch.equal(chunked[1], whole[1]) and torch.allclose(chunked[0], whole[0], atol=1e-5)


def test_two_tower_trains_and_finds_true_top_items() -> None:
    d = latent_data(n_users=200, n_items=300, dim=8, per_user=20, n_clusters=16, tau=0.05, seed=1)
    ids = lambda n: [torch.arange(1, n + 1)[:, None]]  # one id feature, 0 is padding
    torch.manual_seed(0)
    model = TwoTower(Tower([201], 16, [32], 16), Tower([301], 16, [32], 16), temperature=0.1)
    losses = fit(model, ids(200), ids(300), d.pairs, epochs=10, batch_size=128, lr=0.01)
    assert losses[-1] < losses[0] - 0.5
    _, true_top = ExactIndex(d.items)(d.users, 10)
    _, found = ExactIndex(embed(model.item, ids(300)))(embed(model.user, ids(200)), 10)
    assert recall(found, true_top) > 0.25  # chance: 10 / 300


@pytest.mark.parametrize("kind", ["exact", "int8", "ivf", "ivf-int8"])
def test_retrieve_rank_saved_and_reloaded(tmp_path: Path, kind: IndexKind, monkeypatch) -> None:
    from recscale.serve import retrieval_artifact

    torch.manual_seed(0)
    n_users, n_items = 40, 500
    spec = RetrievalSpec(
        user_vocab=[n_users + 1], emb_dim=8, hidden=[16], dim=8, n_items=n_items, index=kind, nlist=16,
        nprobe=4, ranker_dim=8, ranker_hidden=[16], candidates=50, k=10,
    )  # fmt: skip
    user_tower = Tower(spec.user_vocab, spec.emb_dim, spec.hidden, spec.dim)
    users = torch.arange(n_users)
    features = [users[:, None] + 1]
    seen = BloomFilter.sized(capacity=n_users * 20, fp_rate=0.01)
    seen.add(users.repeat_interleave(20), torch.randint(0, n_items, (n_users * 20,)))
    spec = spec.model_copy(update={"bloom_bits": seen.n_bits, "bloom_hashes": seen.n_hashes})
    index = make_index(kind, torch.randn(n_items, spec.dim), spec.nlist, spec.nprobe)
    model = RetrieveRank(user_tower, index, Ranker(n_items, spec.dim, 8, [16]), 50, 10, seen).eval()
    logits, ids = model(features, users)
    assert ids.shape == (n_users, 10)
    assert not seen.might_contain(users[:, None].expand_as(ids), ids).any()
    assert torch.equal(logits, model.ranker(user_tower(features), ids))  # ranker scores, best first
    assert (logits[:, :-1] >= logits[:, 1:]).all()
    save_retrieval(tmp_path / "m", model, spec)
    logits2, ids2 = load_retrieval(tmp_path / "m")(features, users)
    assert torch.equal(ids2, ids) and torch.equal(logits2, logits)
    weights = tmp_path / "m" / WEIGHTS
    good_weights = weights.read_bytes()
    weights.write_bytes(good_weights[:-1] + b"\0")
    with pytest.raises(CheckpointError, match="sha256 does not match"):
        load_retrieval(tmp_path / "m")
    # A hand-edited manifest's true or "8" for a size was read as 1 and 8.
    manifest = tmp_path / "m" / MANIFEST
    good = manifest.read_text()
    for key, value in (("k", "true"), ("dim", '"8"')):
        manifest.write_text(re.sub(rf'"{key}": \d+', f'"{key}": {value}', good))
        with pytest.raises(CheckpointError, match="not a recscale retrieval manifest"):
            load_retrieval(tmp_path / "m")
    # A vocabulary of 0 rows (no room for the padding id 0) was an internal IndexError, not one line.
    manifest.write_text(re.sub(r'"user_vocab": \[\s*\d+', '"user_vocab": [0', good))
    with pytest.raises(CheckpointError, match=r"spec.user_vocab.0: Input should be greater than 0"):
        load_retrieval(tmp_path / "m")
    # A spec asking more than the weights hold (n_items 10^12) is refused before anything is allocated for it.
    weights.write_bytes(good_weights)
    manifest.write_text(re.sub(r'"n_items": \d+', '"n_items": 1000000000000', good))
    with monkeypatch.context() as m:
        m.setattr(retrieval_artifact, "build", lambda spec: pytest.fail("built before the check"))
        with pytest.raises(
            CheckpointError, match=r"gives 16,000,000,00.* weights, more than weights.safetensors holds"
        ):
            load_retrieval(tmp_path / "m")


def test_retrieval_build_and_query_from_the_command_line(tmp_path: Path, shared_data: Path, capsys) -> None:
    from recscale.cli import main
    from recscale.retrieval.movielens import read_movielens

    out = tmp_path / "rt"
    argv = ["retrieval", "build", str(shared_data / "movielens-100k"), "--out", str(out), "--epochs", "1"]
    assert main([*argv, "--k", "5", "--candidates", "30"]) == 0
    capsys.readouterr()
    assert main(["retrieval", "query", str(out), "196", "1"]) == 0
    answer = json.loads(capsys.readouterr().out)
    ml = read_movielens(shared_data / "movielens-100k")
    liked = {
        ml.item_keys[i] for u, i in ml.positives("train").tolist() if ml.user_keys[u] == "196"
    }  # the Bloom filter has no false negatives: none of these comes back
    for user in ("196", "1"):
        items = [x["item"] for x in answer[user]]
        logits = [x["logit"] for x in answer[user]]
        assert len(items) == 5 == len(set(items)) and logits == sorted(logits, reverse=True)
    assert liked and not liked & {x["item"] for x in answer["196"]}
    assert main(["retrieval", "query", str(out), "196", "nobody"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: user 'nobody' is not in the model's catalog (943 users, raw ids as in the training data)"
    )
    (out / "ids.json").write_text((out / "ids.json").read_text().replace('"196"', '"197"', 1))
    assert main(["retrieval", "query", str(out), "196"]) != 0
    assert "ids.json: its sha256 does not match" in capsys.readouterr().err


def test_retrieval_build_refuses_k_above_candidates(tmp_path: Path, shared_data: Path, capsys) -> None:
    """--k above --candidates was accepted, and queries then returned only --candidates items."""
    from recscale.cli import main

    out = tmp_path / "rt"
    argv = ["retrieval", "build", str(shared_data / "movielens-100k"), "--out", str(out), "--epochs", "1"]
    assert main([*argv, "--k", "20", "--candidates", "5"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: retrieval build: --k 20 is more than --candidates 5, the items the ranker chooses from, "
        "so queries would return only 5; give --k <= --candidates\n"
    )
    assert not out.exists()


def test_retrieval_build_refuses_an_out_that_is_no_retrieval_model(
    tmp_path: Path, shared_data: Path, capsys
) -> None:
    """--out of a training run (or any other non-empty directory) was deleted and replaced by the retrieval
    model; querying a directory that is no retrieval model said "the retrieval model is incomplete: delete it"."""
    from recscale.cli import main

    run = tmp_path / "run"
    (run / "ckpt").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    argv = ["retrieval", "build", str(shared_data / "movielens-100k"), "--epochs", "1"]
    assert main([*argv, "--out", str(run)]) == 2
    assert capsys.readouterr().err == (
        f"error: --out {run}: exists and is not a retrieval model; name a new directory (it is created)\n"
    )
    assert sorted(p.name for p in run.iterdir()) == ["ckpt", "config.yaml"]
    assert main(["retrieval", "query", str(run), "196"]) == 2
    assert capsys.readouterr().err == (
        f"error: {run}: not a retrieval model (no manifest.json); build one with "
        "`recscale retrieval build DATA --out DIR`\n"
    )
    scoring = tmp_path / "scoring"
    scoring.mkdir()
    (scoring / "manifest.json").write_text('{"format": "recscale-model", "version": 1}')
    assert main(["retrieval", "query", str(scoring), "196"]) == 2
    assert "is an exported scoring model, not a retrieval model; serve it with `recscale serve`" in (
        capsys.readouterr().err
    )
    assert main([*argv, "--out", str(scoring)]) == 2
    assert "exists and is not a retrieval model" in capsys.readouterr().err
    assert (scoring / "manifest.json").is_file()
    # Inside the data directory: a model named x.inter made the next build find two .inter files.
    data = tmp_path / "ml"
    data.mkdir()
    (data / "ml.inter").write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n")
    assert main(["retrieval", "build", str(data), "--out", str(data / "x.inter")]) == 2
    assert capsys.readouterr().err == (
        f"error: --out {data / 'x.inter'} is inside the data directory {data}; name a directory outside it\n"
    )
    assert sorted(p.name for p in data.iterdir()) == ["ml.inter"]


def test_recscale_serve_answers_a_retrieval_model(tmp_path: Path, shared_data: Path) -> None:
    from fastapi.testclient import TestClient

    from recscale.cli import main
    from recscale.serve.retrieval_artifact import load_retriever, recommend
    from recscale.serve.server import ServeOptions, build_app

    out = tmp_path / "rt"
    argv = ["retrieval", "build", str(shared_data / "movielens-100k"), "--out", str(out), "--epochs", "1"]
    assert main([*argv, "--k", "3", "--candidates", "20"]) == 0
    app, what = build_app(out, 2, ServeOptions())
    assert what == "a retrieval model (943 users, 1,682 items)"
    with TestClient(app) as c:
        assert c.get("/readyz").json()["ready"] is True
        got = c.post("/retrieve", json={"users": ["196", 1]}).json()["items"]
        assert got == recommend(*load_retriever(out), ["196", "1"])
        for body, status, words in (
            (b"{", 400, "not valid JSON"),
            (b'{"users": []}', 422, "non-empty list"),
            (b'{"users": [1.5]}', 422, "strings or integers"),
            (b'{"users": ["1"], "k": 3}', 422, 'the body must be {"users"'),
            (b'{"users": ["1", "2", "3"]}', 413, "at most 2 per request"),
            (b'{"users": ["nobody"]}', 422, "not in the model's catalog"),
            (b'{"users": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "not valid JSON"),  # was a 500
            (b'{"users": ["1"]', 400, "not valid JSON"),
            (b"\xff", 400, "not valid JSON"),
        ):
            r = c.post("/retrieve", content=body)
            assert r.status_code == status and words in r.json()["error"], (body, r.text)


def test_a_retrieval_model_a_kill_set_aside_while_replacing_it_still_serves(tmp_path: Path) -> None:
    """A kill between atomic_dir's two renames (a build into an existing --out) left no model at --out, the
    old one as .OUT.old: `retrieval query OUT` said 'not a retrieval model (no manifest.json)' and `serve OUT`
    read the set-aside copy as an exported scoring model. Both read it now; the next save supersedes it."""
    from recscale.serve.retrieval_artifact import Catalog, load_retriever, recommend
    from recscale.serve.server import ServeOptions, build_app

    spec = RetrievalSpec(
        user_vocab=[4], emb_dim=4, hidden=[8], dim=4, n_items=20, index="exact", ranker_dim=4,
        ranker_hidden=[8], candidates=5, k=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = RetrieveRank(
        Tower(spec.user_vocab, 4, [8], 4), ExactIndex(torch.randn(20, 4)), Ranker(20, 4, 4, [8]), 5, 3, None
    ).eval()
    catalog = Catalog(["a", "b", "c"], [f"i{j}" for j in range(20)], [torch.arange(1, 4)[:, None]])
    out = tmp_path / "m"
    save_retrieval(out, model, spec, catalog)
    want = recommend(*load_retriever(out), ["a", "c"])
    out.rename(tmp_path / ".m.old")
    assert recommend(*load_retriever(out), ["a", "c"]) == want
    assert build_app(out, 8, ServeOptions())[1] == "a retrieval model (3 users, 20 items)"
    save_retrieval(out, model, spec, catalog)
    assert out.is_dir() and not (tmp_path / ".m.old").exists()


def test_an_ivf_build_of_a_catalog_of_fewer_items_than_nprobe(tmp_path: Path) -> None:
    """nlist was cut to the catalog's size but nprobe (4) was not: `retrieval build --index ivf` of 3 items
    failed after the training with an internal error ('IVF needs 1 <= nprobe <= nlist <= items')."""
    from recscale.retrieval.movielens import Interactions
    from recscale.retrieval.recipe import build_pipeline

    n_users = 120  # 360 positives: more than one batch of the towers
    users = torch.arange(n_users).repeat_interleave(3)
    train = torch.stack([users, torch.arange(3).repeat(n_users), torch.ones_like(users)], dim=1)
    data = Interactions(
        [torch.arange(1, n_users + 1)[:, None]], [torch.arange(1, 4)[:, None]], {"train": train},
        [str(u) for u in range(n_users)], ["a", "b", "c"],
    )  # fmt: skip
    pipe, spec = build_pipeline(data, "ivf", epochs=1, candidates=3, k=3)
    assert (spec.nlist, spec.nprobe) == (3, 3)
    _, ids = pipe([torch.tensor([[1]])], torch.tensor([0]))
    assert (ids == -1).all()  # user 0 rated all three well: the Bloom filter leaves nothing


def test_retrieval_build_refuses_fewer_train_positives_than_a_tower_batch() -> None:
    """The towers train on whole batches of 256 positives only: with fewer they stayed untrained without a
    word, and with none the build failed with an internal error (the Bloom filter's capacity >= 1)."""
    from recscale.errors import DataError
    from recscale.retrieval.movielens import Interactions
    from recscale.retrieval.recipe import build_pipeline

    for n_users in (0, 85):  # 0 and 255 positives
        users = torch.arange(n_users).repeat_interleave(3)
        train = torch.stack([users, torch.arange(3).repeat(n_users), torch.ones_like(users)], dim=1)
        data = Interactions(
            [torch.arange(1, n_users + 2)[:, None]], [torch.arange(1, 4)[:, None]], {"train": train},
            [str(u) for u in range(n_users + 1)], ["a", "b", "c"],
        )  # fmt: skip
        with pytest.raises(DataError, match=rf"has {3 * n_users} positive ratings .* fewer than one batch"):
            build_pipeline(data, "exact", epochs=1, candidates=3, k=3)


@pytest.mark.parametrize("kind", ["exact", "ivf"])
def test_retrieve_rank_scores_a_large_request_a_slice_of_users_at_a_time(
    kind: IndexKind, monkeypatch
) -> None:
    """The index scored every (user, item) pair of a call at once and the seen filter hashed each ~7 times
    (~120 bytes a pair): 256 users of a 100,000-item catalogue took 3.2 GB, and one request of the server's
    4,096 users ~50 GB. The users now reach the index a slice at a time, with the same items."""
    from recscale.retrieval import pipeline

    torch.manual_seed(0)
    n_users, n_items = 50, 200
    users = torch.arange(n_users)
    seen = BloomFilter.sized(capacity=n_users * 20, fp_rate=0.01)
    seen.add(users.repeat_interleave(20), torch.randint(0, n_items, (n_users * 20,)))
    index = make_index(kind, torch.randn(n_items, 8), 16, 4)
    model = RetrieveRank(Tower([n_users + 1], 8, [16], 8), index, Ranker(n_items, 8, 8, [16]), 30, 10, seen)
    model.eval()
    features = [users[:, None] + 1]
    logits, ids = model(features, users)  # 10,000 pairs: one call
    calls: list[int] = []
    index.register_forward_pre_hook(lambda _, args: calls.append(len(args[0])))
    monkeypatch.setattr(pipeline, "PAIRS_PER_CALL", 7 * n_items, raising=False)
    logits2, ids2 = model(features, users)
    assert calls == [7] * 7 + [1]
    # The same items; the ranker's logits to float rounding (its matmuls see other batch shapes).
    assert torch.equal(ids2, ids) and torch.allclose(logits2, logits, rtol=0, atol=1e-6)
    assert not seen.might_contain(users[:, None].expand_as(ids), ids).any()


def test_the_retrieval_server_answers_concurrent_requests_in_one_forward(monkeypatch) -> None:
    """The retrieval server answered one request at a time behind a lock, a forward each: requests that queue
    meanwhile are answered together now (as /score batches rows), each with its own users' items as a query
    alone gives them; an unknown user fails only its own request."""
    import threading

    from fastapi.testclient import TestClient

    import recscale.serve.server as server
    from recscale.serve.retrieval_artifact import Catalog, recommend
    from recscale.serve.server import ServeOptions, create_retrieval_app

    torch.manual_seed(0)
    model = RetrieveRank(
        Tower([8], 4, [8], 4), ExactIndex(torch.randn(20, 4)), Ranker(20, 4, 4, [8]), 5, 3, None
    ).eval()
    catalog = Catalog(
        [f"u{i}" for i in range(7)], [f"i{j}" for j in range(20)], [torch.arange(1, 8)[:, None]]
    )
    alone = {u: recommend(model, catalog, [u])[u] for u in catalog.user_keys}
    forwards: list[list[str]] = []
    monkeypatch.setattr(
        server, "recommend", lambda m, c, users: forwards.append(users) or recommend(m, c, users)
    )
    app = create_retrieval_app(model, catalog, 4, ServeOptions(max_wait_ms=300))
    asked = [["u1", "u2"], ["u3"], ["u2", "u4"], ["nobody"], ["u5", "u6", "u0"]]
    with TestClient(app) as c:
        forwards.clear()  # the warm-up query
        answers: dict[int, object] = {}
        threads = [
            threading.Thread(
                target=lambda i=i: answers.update({i: c.post("/retrieve", json={"users": asked[i]})})
            )
            for i in range(len(asked))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, users in enumerate(asked):
        r = answers[i]
        if users == ["nobody"]:
            assert r.status_code == 422 and "not in the model's catalog" in r.json()["error"]
        else:
            assert r.status_code == 200 and r.json()["items"] == {u: alone[u] for u in users}, (users, r.text)
    # Some forward answered several requests at once: its users are no one request's.
    assert any(not any(set(f) <= set(users) for users in asked) for f in forwards), forwards
