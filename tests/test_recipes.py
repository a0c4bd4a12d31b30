"""The tuned recipes (configs/<dataset>/<model>.yaml) are ordinary run configs, and the quality suites train
exactly them, so ``recscale train configs/frappe/wukong.yaml`` trains the suite's Wukong row."""

import csv
import importlib.util
import shlex
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from recscale.config import load_config
from recscale.config_files import read_yaml_mapping
from recscale.errors import ConfigError
from recscale.scaling.sweep import load_sweep

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# configs/sweeps holds sweep files (their own format); configs/dmt holds tower assignments (JSON).
RUN_CONFIGS = sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent.name != "sweeps")
SWEEPS = sorted((CONFIGS / "sweeps").glob("*.yaml"))
RECIPES = sorted(p for p in RUN_CONFIGS if p.parent != CONFIGS)
SUITES = sorted((REPO / "bench").glob("quality_*.yaml"))


def _load_quality() -> ModuleType:
    sys.path.insert(0, str(REPO / "bench"))  # as when run as a script: it imports its neighbours
    spec = importlib.util.spec_from_file_location("bench_quality", REPO / "bench" / "quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # bench/ is scripts, not a package
    return module


quality = _load_quality()


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO))


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=_rel)
def test_run_configs_validate(path):
    cfg = load_config(path)
    assert cfg.data.schema.sparse


@pytest.mark.parametrize("path", SWEEPS, ids=_rel)
def test_sweeps_validate(path):
    _, runs = load_sweep(path)
    assert runs


@pytest.mark.parametrize("path", RECIPES, ids=_rel)
def test_recipes_extend_their_dataset_and_cite_their_figure(path):
    assert read_yaml_mapping(path)["base"] == f"../{path.parent.name}.yaml"
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and "docs/" in first and "AUC" in first, f"{path}: first line {first!r}"


@pytest.mark.parametrize("suite_path", SUITES, ids=_rel)
def test_suites_train_their_recipes(suite_path):
    """A suite entry naming a recipe trains load_config(recipe) plus its overrides; the Frappe and
    MovieLens suites name configs/<dataset>/<model>.yaml and nothing else."""
    suite = yaml.safe_load(suite_path.read_text())
    dataset = suite_path.stem.removeprefix("quality_")
    recipes = (CONFIGS / dataset).is_dir()
    for model, (config, overrides) in quality.entries(suite).items():
        if recipes:
            assert (config, overrides) == (f"configs/{dataset}/{model}.yaml", []), model
        if isinstance(suite["models"][model], dict):
            want = load_config(REPO / config, [*(o for o in overrides if o[:2] != "--"), "seed=3"])
            have = quality.run_config(config, [*overrides, "seed=3"])
            assert have.model_copy(update={"train": want.train}) == want  # train: only progress differs
            assert have.train == want.train.model_copy(update={"progress": False})


@pytest.mark.parametrize("suite_path", SUITES, ids=_rel)
def test_suites_train_what_their_published_rows_trained(suite_path):
    """Every row of docs/quality_<suite>*.csv (the runs behind the published figures; their commands
    spell out the overrides the suites held before the recipes) resolves to the RunConfig, byte for byte
    in YAML, and the launcher options the suite trains now: the same key bench/quality.py reuses rows by."""
    suite = yaml.safe_load(suite_path.read_text())
    name = suite_path.stem.removeprefix("quality_")
    models = quality.entries(suite)
    tables = [REPO / "docs" / f"quality_{name}.csv", *(REPO / "docs").glob(f"quality_{name}_*.csv")]
    tables = [t for t in tables if t.is_file()]
    if not tables:
        pytest.skip(f"no docs/quality_{name}*.csv")
    with open(tables[0]) as f:
        assert {row["model"] for row in csv.DictReader(f)} == set(models), f"{tables[0]} misses a model"
    for table in tables:
        recorded = quality.recorded_rows(table)
        with open(table) as f:
            rows = list(csv.DictReader(f))
        assert len(recorded) == len(rows)  # every command still resolves, and to a distinct run
        for row in rows:
            config, overrides = models[row["model"]]
            key = quality.run_key(config, [*overrides, f"seed={row['seed']}"])
            assert recorded.get(key) == row, f"{table.name}: {row['model']} seed {row['seed']}"


def test_recorded_row_matches_a_recipe_command_not_another_config(tmp_path):
    recipe = "configs/movielens/wukong.yaml"
    spelled = ["configs/movielens.yaml", "model.name=wukong", "train.embedding_l2=0.5", "model.num_layers=3"]
    table = tmp_path / "t.csv"
    table.write_text(
        "model,command\n"
        f"wukong,{shlex.join(['recscale', 'train', *spelled, 'seed=1'])}\n"
        f"gone,{shlex.join(['recscale', 'train', 'configs/none.yaml', 'seed=1'])}\n"  # skipped, not an error
    )
    recorded = quality.recorded_rows(table)
    assert recorded[quality.run_key(recipe, ["seed=1"])]["model"] == "wukong"
    assert quality.run_key(recipe, ["seed=2"]) not in recorded
    assert quality.run_key(recipe, ["seed=1", "--nproc=2"]) not in recorded


def test_a_row_whose_recipe_changed_since_it_trained_is_not_reused(tmp_path):
    """A row's config_sha is the hash of the config it trained: once the recipe its command names says
    something else, the command resolves to another hash and the row is stale, not a result to reuse."""
    recipe = "configs/movielens/wukong.yaml"
    key = quality.run_key(recipe, ["seed=1"])
    command = shlex.join(["recscale", "train", recipe, "seed=1"])
    table = tmp_path / "t.csv"
    table.write_text(f"model,config_sha,command\nwukong,{quality.config_sha(recipe, ['seed=1'])},{command}\n")
    assert key in quality.recorded_rows(table)
    other = quality.config_sha(recipe, ["seed=1", "train.epochs=3"])
    table.write_text(f"model,config_sha,command\nwukong,{other},{command}\n")
    assert quality.recorded_rows(table) == {}
    # A field spelled out at its default trains the same thing: same hash (so does a field added later).
    assert quality.config_sha(recipe, ["seed=1", "data.on_bad_row=error"]) == quality.config_sha(
        recipe, ["seed=1"]
    )


def test_bad_suite_entry_is_one_line():
    with pytest.raises(ConfigError, match=r"models\.wukong: write \{config"):
        quality.entries({"models": {"wukong": {"recipe": "configs/frappe/wukong.yaml"}}})
    with pytest.raises(ConfigError, match="suite's config"):
        quality.entries({"models": {"wukong": ["model.name=wukong"]}})  # overrides of no config


SYNTHETIC = "data: {format: synthetic}\nmodel: {name: wukong, fmb_mlp: [32, 32]}\n"


def test_base_chain_merges_mappings_and_replaces_the_rest(tmp_path):
    (tmp_path / "base.yaml").write_text(
        SYNTHETIC + "train: {epochs: 3, dense_optimizer: {name: adamw, lr: 0.002}}\n"
    )
    (tmp_path / "mid").mkdir()
    (tmp_path / "mid" / "mid.yaml").write_text(
        "base: ../base.yaml\ntrain: {epochs: 5}\nmodel: {num_layers: 3}\n"
    )
    (tmp_path / "top.yaml").write_text(
        "base: mid/mid.yaml\ntrain: {dense_optimizer: {lr: 0.01}}\nmodel: {fmb_mlp: [64]}\n"
    )
    cfg = load_config(tmp_path / "top.yaml", ["train.epochs=7"])
    assert cfg.data.format == "synthetic"
    opt = cfg.train.dense_optimizer
    assert (cfg.train.epochs, opt.name, opt.lr) == (7, "adamw", 0.01)  # overrides apply last
    assert (cfg.model.params.num_layers, cfg.model.params.fmb_mlp) == (3, [64])  # a list is replaced


@pytest.mark.parametrize(
    "files, words",
    [
        ({"a.yaml": "base: a.yaml\n"}, ["a.yaml: base a.yaml closes a cycle: a.yaml -> a.yaml"]),
        (  # the cycle was "a.yaml: base sub/b.yaml includes itself", which it does not
            {"a.yaml": "base: sub/b.yaml\n", "sub/b.yaml": "base: ../a.yaml\n"},
            ["sub/b.yaml: base ../a.yaml closes a cycle: a.yaml -> sub/b.yaml -> a.yaml"],
        ),
        (  # a cycle below the file given: the chain starts where the cycle does
            {"a.yaml": "base: b.yaml\n", "b.yaml": "base: c.yaml\n", "c.yaml": "base: b.yaml\n"},
            ["c.yaml: base b.yaml closes a cycle: b.yaml -> c.yaml -> b.yaml"],
        ),
        ({"a.yaml": "base: gone.yaml\n" + SYNTHETIC}, ["gone.yaml", "no such file"]),
        ({"a.yaml": "base: [x.yaml]\n" + SYNTHETIC}, ["a.yaml", "base must be the path"]),
        (
            {"a.yaml": "base: b.yaml\n", "b.yaml": "base: c.yaml\ndata: [unclosed\n"},
            ["b.yaml:", "not valid YAML"],
        ),
    ],
)
def test_bad_base_is_one_line_naming_the_file(tmp_path, monkeypatch, files, words):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)  # the chain shows paths relative to the working directory
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "a.yaml")
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg
