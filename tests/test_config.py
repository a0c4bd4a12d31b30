import errno
import os
import re
from pathlib import Path

import pytest
import yaml

from recscale.config import load_config, validate_config
from recscale.config_files import load_yaml
from recscale.errors import ConfigError
from recscale.models.registry import params_class
from recscale.models.wukong import WukongParams

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["demo", "frappe", "movielens", "criteo"])
def test_shipped_configs_validate(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    # The shipped configs set only the model's name and embedding: its own params are the defaults.
    assert cfg.model.params == params_class(cfg.model.name)()
    assert type(cfg.model.params) is params_class(cfg.model.name)
    assert cfg.data.schema.sparse


def test_model_params_are_validated_with_their_types():
    overrides = ["model.num_layers=3", "model.fmb_mlp=[512]", "model.dropout=0", "model.fm=full"]
    params = load_config(CONFIGS / "frappe.yaml", overrides).model.params
    assert isinstance(params, WukongParams)
    assert (params.num_layers, params.fmb_mlp, params.dropout, params.fm) == (3, [512], 0.0, "full")
    assert type(params.dropout) is float  # YAML's 0 is an int: validated into the declared type
    assert params.n_f == WukongParams().n_f  # keys not given keep their defaults


@pytest.mark.parametrize(
    "override, words",
    [
        ("model.num_layers=three", ["model.num_layers", "integer"]),
        ("model.num_layers=0", ["model.num_layers", "greater than or equal to 1"]),
        ("model.dropout=1.5", ["model.dropout", "less than 1"]),
        ("model.fm=huge", ["model.fm", "'optimized' or 'full'"]),
        ("model.fmb_mlp=512", ["model.fmb_mlp", "list"]),
    ],
)
def test_wrong_model_params_are_refused_naming_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "frappe.yaml", [override])
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_overrides_are_typed():
    cfg = load_config(
        CONFIGS / "frappe.yaml", ["train.max_steps=7", "train.dense_optimizer.lr=0.01", "model.name=dlrm"]
    )
    assert cfg.train.max_steps == 7 and cfg.train.dense_optimizer.lr == 0.01 and cfg.model.name == "dlrm"


@pytest.mark.parametrize(
    "override",  # the last: a shell split the unquoted {train: 1000, ...} at the space; a date was a ValueError
    ["train.batch_size=[1", "model.mlp=a: b: c", "data.schema.sparse=[{name:", "train.max_steps=2020-13-01"],
)
def test_an_override_that_is_not_yaml_is_one_line_naming_it(override):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "frappe.yaml", [override])
    assert str(e.value).startswith(f"override '{override}': the value is not valid YAML (")
    assert "\n" not in str(e.value)


def test_an_override_a_yaml_comment_would_cut_is_refused(tmp_path):
    """A path holding ' #' (data.train=/data/run #3/train.csv) was read as '/data/run' and a comment: the error
    then named a file the user never gave. Refused, saying to quote it; quoted, it is the path."""
    path = f"{tmp_path}/run #3/train.csv"
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "frappe.yaml", [f"data.train={path}"])
    assert str(e.value) == (
        f"override 'data.train={path}': ' #' starts a YAML comment, which cut the value to '{tmp_path}/run'; "
        f"quote the value (the quotes inside the shell's), e.g. 'data.train=\"{path}\"'"
    )
    assert load_config(CONFIGS / "frappe.yaml", [f'data.train="{path}"']).data.train == path
    assert load_config(CONFIGS / "frappe.yaml", ["train.max_steps=7"]).train.max_steps == 7


def _holding_itself(items: list) -> list:
    items.append(items)
    return items


def base() -> dict:
    return {"data": {"format": "synthetic"}, "model": {"name": "wukong"}}


@pytest.mark.parametrize(
    "patch, words",
    [
        ({"trian": {}}, ["trian", "unknown key"]),
        ({"train": {"batch_size": "big"}}, ["train.batch_size", "integer"]),
        ({"train": {"batch_size": 0}}, ["train.batch_size", "greater than or equal to 1"]),
        ({"model": {"name": "nope"}}, ["unknown model 'nope'", "wukong"]),
        ({"model": {"name": "wukong", "num_layrs": 3}}, ["model.num_layrs", "unknown key"]),
        # An unknown key names the keys it may have meant: a close spelling, or the same name deeper
        ({"trian": {}}, ["did you mean train?"]),
        ({"model": {"name": "wukong", "num_layrs": 3}}, ["did you mean model.num_layers?"]),
        (
            {"train": {"lr": 0.1}},
            ["train.lr: unknown key", "did you mean train.dense_optimizer.lr or train.sparse"],
        ),
        (
            {"model": {"name": "wukong", "dim": 8}},
            ["model.dim: unknown key", "did you mean model.embedding.dim?"],
        ),
        ({"data": {"format": "xml"}}, ["data.format", "csv"]),
        ({"data": {"format": "csv"}}, ["data.train is required"]),
        (
            {"train": {"sparse_optimizer": {"name": "lbfgs", "lr": 1}}},
            ["sparse_optimizer", "rowwise_adagrad"],
        ),
        # pydantic reads a boolean as 1 or 0: max_steps: true trained one step
        ({"train": {"max_steps": True}}, ["train.max_steps", "expected a number, not true"]),
        ({"model": {"name": "wukong", "num_layers": False}}, ["model.num_layers", "not false"]),
        ({"model": {"name": "lr", "embedding": {"dim": True}}}, ["model.embedding.dim", "not true"]),
        (  # YAML's {format:mxfp4}, no space after the colon, is one key: "unknown key" alone puzzled
            {"model": {"name": "lr", "quant": {"format:mxfp4": None}}},
            [
                "model.quant.format:mxfp4: unknown key (YAML reads a colon without a space as part of the key: "
                "write 'format: mxfp4')"
            ],
        ),
        (  # the deep teacher was a plain pydantic model, without the config's checks: this was 1 layer
            {"data": {"format": "synthetic", "synthetic": {"teacher": {"kind": "deep", "num_layers": True}}}},
            ["data.synthetic.teacher.num_layers: expected a number, not true"],
        ),
        # ...also inside a list or mapping of numbers: this was a hidden layer of width 1, a rows count of 1
        (
            {"model": {"name": "dlrm", "top_mlp": [True, 64]}},
            ["model.top_mlp: expected numbers, got true"],
        ),
        (
            {"data": {"format": "synthetic", "synthetic": {"rows": {"train": 100, "valid": True}}}},
            ["data.synthetic.rows: expected numbers, got true"],
        ),
        # A YAML alias (&a [true, *a]) makes a list that holds itself: the search for a boolean ends
        (
            {"model": {"name": "dlrm", "top_mlp": _holding_itself([True])}},
            ["model.top_mlp: expected numbers, got true"],
        ),
        (
            {"model": {"name": "dlrm", "top_mlp": _holding_itself([])}},
            ["model.top_mlp.0: Input should be a valid integer"],
        ),
        # A quoted number is YAML's string, which pydantic read as the number: dim: '16' trained with d=16
        (
            {"model": {"name": "lr", "embedding": {"dim": "16"}}},
            ["model.embedding.dim: expected a number, not the string '16' (write it without quotes)"],
        ),
        (
            {"model": {"name": "dlrm", "top_mlp": [64, "32"]}},
            ["model.top_mlp: expected numbers, got the string '32' (write them without quotes)"],
        ),
        (
            {"train": {"dense_optimizer": {"name": "adam", "lr": "1e-3"}}},
            ["train.dense_optimizer.lr: expected a number, not the string '1e-3'"],
        ),
        ({"dmt": {"towers": "2"}}, ["dmt.towers: expected a number, not the string '2'"]),
        (  # the sequence encoder's section was a plain pydantic model, without the config's checks
            {"model": {"name": "lr", "embedding": {"sequence": {"layers": True}}}},
            ["model.embedding.sequence.layers: expected a number, not true"],
        ),
        # a check of the model's parameters together was named 'model.config', a key that does not exist
        ({"model": {"name": "dhen", "modules": ["dot", "dot"]}}, ["invalid config: model: DHEN modules"]),
        (  # the learned planner's cap was dropped without a word under another sharding
            {"distributed": {"learned": {"memory_cap_mb": 1}}},
            ["distributed", "learned.memory_cap_mb applies to sharding: learned", "table_wise"],
        ),
        (  # found by the dense wrapper once the ranks had started
            {"distributed": {"dense": "fsdp", "qcomms": {"dense": "fp16"}}},
            ["distributed: ", "qcomms.dense compresses DDP's all-reduce", "leave qcomms.dense fp32"],
        ),
    ],
)
def test_config_errors_name_the_key(patch, words):
    raw = base()
    raw.update(patch)
    with pytest.raises(ConfigError) as e:
        validate_config(raw)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_an_unknown_key_is_not_matched_inside_a_mapping_of_names():
    """distributed.tables maps feature names to plans: its plans' keys (type, ranks) are not keys of
    distributed, nor is another section's (dmt.tower_module.type), so ``distributed.type`` has nothing to
    suggest."""
    with pytest.raises(ConfigError) as e:
        validate_config(base() | {"distributed": {"type": "row_wise"}})
    assert str(e.value).endswith(
        "distributed.type: unknown key (check the spelling; see configs/ for examples)"
    )


@pytest.mark.parametrize(
    "override, words",
    [
        # The readers' options were plain pydantic models, checked only when the first file was read: a
        # threshold of true (1.0) made every rating a click, one of inf none.
        ("data.options.rating_threshold=true", "data.options.rating_threshold: expected a number, not true"),
        (
            "data.options.rating_threshold=.inf",
            "data.options.rating_threshold: Input should be a finite number",
        ),
        (
            "data.options.fractions=[true,false,false]",
            "data.options.fractions: expected numbers, got true",
        ),
        ("data.options.ratng=3", "data.options.ratng: unknown key for format 'movielens'"),
    ],
)
def test_data_options_are_checked_with_the_config(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "movielens.yaml", [override])
    assert words in str(e.value) and "\n" not in str(e.value)


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "none.yaml")
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory; name a YAML file$"):
        load_config(tmp_path)  # was "not found", of a directory that is there
    (tmp_path / "bad.yaml").write_text("data: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        load_config(CONFIGS / "demo.yaml", ["train.max_steps"])
    # A data file given as the config: was "not valid YAML (...); fix the file's indentation or quoting there".
    (tmp_path / "data.parquet").write_bytes(b"PAR1\x15\x04\x15\x10\x00\xbc" + bytes(100))
    with pytest.raises(ConfigError, match=r"data\.parquet: binary data, not a YAML file; a config is a YAML"):
        load_config(tmp_path / "data.parquet")
    (tmp_path / "utf16.yaml").write_bytes("seed: 3\n".encode("utf-16"))  # with its BOM: still YAML
    with pytest.raises(
        ConfigError, match="^invalid config: data: Field required"
    ):  # read, its sections lacking
        load_config(tmp_path / "utf16.yaml")


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("data.synthetic.rows={valid: 100}", "data.synthetic.rows has no train split"),
        ("data.synthetic.rows={train: 100}", "data.synthetic.rows has no valid"),
    ],
)
def test_synthetic_rows_without_a_needed_split_are_refused(override, words):
    with pytest.raises(ConfigError, match=words):
        load_config(CONFIGS / "demo.yaml", [override, "train.calibrate=true"])


def test_numbers_with_an_exponent_are_numbers(tmp_path):
    # PyYAML (YAML 1.1) read 1e3 and 1e-3 as strings: max_steps: 1e3 was 'unable to parse string as an
    # integer'. They are read as YAML 1.2 reads them, in files and in dotted overrides alike.
    (tmp_path / "c.yaml").write_text(
        f"base: {CONFIGS / 'demo.yaml'}\ntrain: {{max_steps: 1e3, dense_optimizer: {{name: adam, lr: 1e-3}}}}\n"
    )
    cfg = load_config(tmp_path / "c.yaml", ["train.grad_clip=1e2"])
    assert (cfg.train.max_steps, cfg.train.dense_optimizer.lr, cfg.train.grad_clip) == (1000, 1e-3, 100.0)
    with pytest.raises(ConfigError, match="model.embedding.dim: .* fractional part"):
        load_config(CONFIGS / "demo.yaml", ["model.embedding.dim=2.5e0"])


def test_overrides_set_list_items_by_index():
    """`data.schema.sparse.1.min_count=3` was "'sparse' is not a section": a list item could only be
    changed by retyping the whole list."""
    cfg = load_config(CONFIGS / "frappe.yaml", ["data.schema.sparse.1.min_count=3", "model.name=dlrm",
                                                 "model.top_mlp=[8, 4]", "model.top_mlp.1=2"])  # fmt: skip
    assert (cfg.data.schema.sparse[1].name, cfg.data.schema.sparse[1].min_count) == ("item", 3)
    assert cfg.data.schema.sparse[0].min_count == 1 and cfg.model.params.top_mlp == [8, 2]


@pytest.mark.parametrize(
    ("override", "words"),
    [
        (
            "data.schema.sparse.10.name=x",
            "'10' is no index of its list of 10 items; use 0 to 9, or set the whole",
        ),
        ("data.schema.sparse.-1.name=x", "'-1' is no index of its list of 10 items"),
        ("data.schema.sparse.user.name=x", "'user' is no index of its list of 10 items"),
        ("data.schema.label.x=3", "data.schema.label is 'label', which has no keys; set it whole"),
        # an empty name between dots was a key '' that the schema reported as "train.: unknown key"
        ("train..max_steps=3", "write the key as its names joined by single dots"),
        ("train.max_steps.=3", "write the key as its names joined by single dots"),
        (".train=3", "write the key as its names joined by single dots"),
    ],
)
def test_overrides_that_miss_a_list_item_or_a_key_say_how(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "frappe.yaml", [override])
    assert str(e.value).startswith(f"override '{override}': ") and words in str(e.value), e.value


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (  # was two errors under distributed.sharding.literal['planner','learned'] and .literal['data_parallel',...]
            "distributed.sharding=tablewise",
            "distributed.sharding: Input should be one of 'planner', 'learned', 'data_parallel', 'table_wise', "
            "'column_wise', 'row_wise', 'table_row_wise', 'table_column_wise'",
        ),
        (  # was model.embedding.sequence.buckets.constrained-int: ...; ...buckets.literal['pow2']: ...
            "model.embedding.sequence.buckets=pow3",
            "model.embedding.sequence.buckets: Input should be a valid integer, unable to parse string as an "
            "integer, or Input should be 'pow2'",
        ),
        (
            "train.precision=fp8",
            "train.precision: Input should be 'fp32' or 'bf16'",
        ),  # no union: as pydantic says
    ],
)
def test_a_union_type_is_one_error_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "demo.yaml", [override])
    assert str(e.value) == f"invalid config: {message}"


def test_a_key_given_twice_is_refused_with_its_lines(tmp_path):
    """PyYAML keeps the last of two equal keys: a second ``train:`` section dropped the first one's
    settings without a word. A key that overrides one merged in by ``<<`` is no repeat."""
    (tmp_path / "c.yaml").write_text(
        f"base: {CONFIGS / 'demo.yaml'}\ntrain: {{max_steps: 3}}\nseed: 1\ntrain: {{batch_size: 64}}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "c.yaml")
    assert str(e.value).startswith(
        f"{tmp_path / 'c.yaml'}:4:1: not valid YAML (key 'train' repeats the one on line 2"
    )
    with pytest.raises(ConfigError, match="key 'max_steps' repeats the one on line 1"):
        load_config(CONFIGS / "demo.yaml", ["train={max_steps: 3, max_steps: 4}"])
    assert load_yaml("a: &t {b: 1, c: 2}\nd: {<<: *t, b: 3}\n")["d"] == {"b": 3, "c": 2}


def test_one_string_of_overrides_is_refused():
    """load_config(path, "train.max_steps=3") read the string letter by letter: "override 't'"."""
    with pytest.raises(ConfigError, match=r"give a list of key=value strings, e.g. \['train.max_steps=3'\]"):
        load_config(CONFIGS / "demo.yaml", "train.max_steps=3")  # type: ignore[arg-type]


def test_an_error_in_a_schema_feature_names_the_feature():
    """'data.schema.sparse.8.max_len' alone made a user count the features to find which one."""
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "frappe.yaml", ["data.schema.sparse=[{name: user}, {name: item, max_len: 0}]"])
    assert str(e.value).startswith("invalid config: data.schema.sparse.1.max_len ('item'): ")


@pytest.mark.parametrize("cap", ["min_count: 5", "max_vocab: 100"])
def test_hash_buckets_with_a_vocabulary_cap_is_refused(cap):
    """min_count and max_vocab beside hash_buckets were ignored without a word: every rare id kept a bucket."""
    with pytest.raises(ConfigError, match=r"data.schema.sparse.0 .*'user': hash_buckets hashes every id"):
        load_config(
            CONFIGS / "frappe.yaml", [f"data.schema.sparse=[{{name: user, hash_buckets: 64, {cap}}}]"]
        )


@pytest.mark.parametrize(
    ("feature", "says"),
    [
        ("{name: user, sep: ';'}", "sep splits a multi-id cell; set multi=true or drop sep"),  # was ignored
        # 'a:0.5:b' split on ':' read ids and weights wrongly, without a word
        (
            "{name: user, multi: true, weighted: true, sep: ':'}",
            "sep ':' holds ':', which separates a weighted id",
        ),
    ],
)
def test_a_sep_the_reader_would_misuse_or_ignore_is_refused(feature, says):
    with pytest.raises(ConfigError, match=rf"data.schema.sparse.0 .*'user': {re.escape(says)}"):
        load_config(CONFIGS / "frappe.yaml", [f"data.schema.sparse=[{feature}]"])


@pytest.mark.parametrize("fill", ["1e39", "-1e39"])
def test_a_dense_fill_beyond_float32_is_refused(fill):
    """fill: 1e39 passed as a finite number but is infinite in float32: training on rows without a missing
    value went through, then the first missing value of valid, eval or a served request failed with
    'dense features hold NaN or infinite values after preprocessing'."""
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "criteo.yaml", [f"data.schema.dense=[{{name: I1, fill: {fill}}}]"])
    assert str(e.value).startswith("invalid config: data.schema.dense.0.fill ('I1'): "), e.value
    assert "beyond float32's range" in str(e.value)
    load_config(CONFIGS / "criteo.yaml", ["data.schema.dense=[{name: I1, fill: -3.4e38}]"])


@pytest.mark.parametrize(
    "schema",
    [
        "{label: click, sparse: [{name: label}]}",
        "{sparse: [{name: tags, multi: true, weighted: true}, {name: tags__w}]}",
    ],
)
def test_a_feature_named_as_a_column_recscale_makes_is_refused(schema):
    """A sparse feature 'label' beside schema.label: click made two 'label' columns: 'internal error KeyError:
    Field "label" exists 2 times in schema' in data prepare."""
    with pytest.raises(ConfigError, match=r"data.schema: .* clash with a column recscale makes"):
        load_config(CONFIGS / "frappe.yaml", [f"data.schema={schema}"])


@pytest.mark.parametrize("name", ["user.id", "price/unit", "../../../x", ""])
def test_a_sparse_name_that_cannot_name_a_table_and_files_is_refused(name):
    """'user.id' (a CSV header) was 'internal error KeyError: module name can't contain "."' at model build,
    'price/unit' an OS error naming a scratch file, and '../../../x' wrote x.values.bin outside the run."""
    with pytest.raises(
        ConfigError, match=r"data.schema.sparse.0 .*must be non-empty and hold no '\.', '/' or NUL"
    ):
        load_config(CONFIGS / "frappe.yaml", [f"data.schema={{sparse: [{{name: '{name}'}}]}}"])


def test_a_sparse_name_too_long_to_name_its_files_is_refused():
    """A 300-character column name (a generated one) failed while materialising with 'File name too long (the
    path is too long; choose a shorter one)': the run directory's path was fine, the feature's name was not."""
    with pytest.raises(ConfigError, match=r"is 300 bytes, .* at most 243 bytes; rename the column"):
        load_config(CONFIGS / "frappe.yaml", [f"data.schema={{sparse: [{{name: {'u' * 300}}}]}}"])
    with pytest.raises(ConfigError, match=r"is 244 bytes"):  # bytes, not characters: 'é' is 2 in UTF-8
        load_config(CONFIGS / "frappe.yaml", [f"data.schema={{sparse: [{{name: {'é' * 122}}}]}}"])
    load_config(CONFIGS / "frappe.yaml", [f"data.schema={{sparse: [{{name: {'u' * 243}}}]}}"])


def test_options_for_synthetic_data_are_refused():
    """data.options.delimiter=x on synthetic data was dropped without a word."""
    with pytest.raises(ConfigError, match="data.options: format 'synthetic' reads no file and takes none"):
        load_config(CONFIGS / "demo.yaml", ["data.options.delimiter=x"])


@pytest.mark.parametrize("spelled", ["\\t", "tab"])
def test_a_tab_delimiter_spelled_out_says_how_to_write_a_tab(spelled):
    """`data inspect --delimiter` takes \\t and tab for a tab; data.options.delimiter (YAML's plain \\t is a
    backslash and a t) said only "String should have at most 1 character"."""
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "frappe.yaml", [f"data.options.delimiter={spelled}"])
    assert str(err.value).startswith(
        f"data.options.delimiter: '{spelled}' is not a tab: write a tab in double"
    )
    assert load_config(CONFIGS / "frappe.yaml", ['data.options.delimiter="\\t"']).data.options == {
        "delimiter": "\t"
    }


def test_a_home_directory_path_is_expanded(tmp_path, monkeypatch):
    """data paths starting with ~ (YAML and overrides reach recscale unexpanded) were 'no such file'."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(CONFIGS / "frappe.yaml", ["data.train=~/f/train.csv", "data.prepared=~/prep"])
    assert (cfg.data.train, cfg.data.prepared) == (f"{tmp_path}/f/train.csv", f"{tmp_path}/prep")
    assert cfg.data.valid == load_config(CONFIGS / "frappe.yaml").data.valid  # others as written


@pytest.mark.parametrize("code", [errno.EACCES, errno.EIO])
def test_a_config_that_cannot_be_read_is_the_disks_error(tmp_path, monkeypatch, code):
    """A run's config.yaml this user may not read (a run copied from another user) said 'is corrupt or was
    edited by hand ...; restore it or train a new run'. It is the disk's error naming the file."""
    from recscale.train.runs import run_config

    config = tmp_path / "config.yaml"
    config.write_text("seed: 0\n")
    read_bytes = Path.read_bytes

    def unreadable(self: Path) -> bytes:
        if self == config:
            raise OSError(code, os.strerror(code), str(self))
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", unreadable)
    for read in (lambda: run_config(tmp_path), lambda: load_config(config)):
        with pytest.raises(OSError) as e:
            read()
        assert e.value.errno == code and e.value.filename == str(config)


@pytest.mark.parametrize("which", ["dense_optimizer", "sparse_optimizer"])
def test_an_eps_given_to_sgd_is_refused(which):
    """SGD takes no eps: train.<which>.eps with name sgd was accepted and dropped without a word."""
    with pytest.raises(ConfigError, match=rf"train\.{which}\.eps: sgd takes no eps"):
        load_config(CONFIGS / "demo.yaml", [f"train.{which}.name=sgd", f"train.{which}.eps=0.1"])
    # The default eps (a run's saved config.yaml holds it) is not a choice: sgd still validates.
    cfg = load_config(CONFIGS / "demo.yaml", [f"train.{which}.name=sgd"])
    assert validate_config(yaml.safe_load(cfg.to_yaml())).model_dump() == cfg.model_dump()


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("data.train=clicks.csv", "data.train: format 'synthetic' reads no file"),
        ("data.test=clicks.csv", "data.test: format 'synthetic' reads no file"),
        ("data.schema={label: click, sparse: [{name: user}]}", "data.schema: format 'synthetic'"),
    ],
)
def test_a_file_or_schema_given_to_synthetic_data_is_refused(override, words):
    """Format synthetic reads no file: data.train (or a schema) was dropped without a word, and the run
    trained on the teacher's data instead of the file it named."""
    with pytest.raises(ConfigError, match=words):
        load_config(CONFIGS / "demo.yaml", [override])


def test_a_synthetic_spec_given_to_file_data_is_refused():
    """data.synthetic under a file format was dropped without a word."""
    with pytest.raises(ConfigError, match="data.synthetic: format 'csv' reads data.train"):
        load_config(CONFIGS / "frappe.yaml", ["data.synthetic={vocab_sizes: 10}"])


@pytest.mark.parametrize(
    ("config", "override", "words"),
    [
        ("demo", "data.synthetic.rows={train: 100, test: 10}", "data.synthetic.rows has no valid"),
        ("frappe", "data.valid=null", "data.valid is not set"),
    ],
)
def test_a_report_fraction_without_a_valid_split_is_refused(config, override, words):
    """data.report_fraction holds out valid rows: without a valid split it was dropped without a word."""
    with pytest.raises(
        ConfigError, match=f"data.report_fraction holds out rows of the valid split, and {words}"
    ):
        load_config(CONFIGS / f"{config}.yaml", [override, "data.report_fraction=0.5"])


@pytest.mark.parametrize(
    ("encoder", "key", "value"),
    [("causal", "target", "s0"), ("causal", "softmax", "true"), ("causal", "attention_hidden", "[64]"),
     ("din", "layers", "2"), ("din", "heads", "4")],
)  # fmt: skip
def test_a_sequence_key_the_encoder_does_not_read_is_refused(encoder, key, value):
    """The causal encoder reads no DIN key (target, softmax, attention_hidden) and DIN no causal block's
    (layers, heads): they were dropped without a word."""
    seq = ["data.synthetic.num_history=1", f"model.embedding.sequence.encoder={encoder}"]
    with pytest.raises(
        ConfigError, match=rf"model\.embedding\.sequence\.{key}: the {encoder} encoder does not use"
    ):
        load_config(CONFIGS / "demo.yaml", [*seq, f"model.embedding.sequence.{key}={value}"])
    # causal_din reads them all.
    load_config(
        CONFIGS / "demo.yaml",
        [*seq, "model.embedding.sequence.encoder=causal_din", f"model.embedding.sequence.{key}={value}"],
    )


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            ["model.embedding.small_dim=8"],
            "model.embedding: small_dim is set but small_dim_features lists no",
        ),
        (["model.embedding.qr_op=add"], "model.embedding: qr_op is set but qr_buckets names no feature"),
        (
            ["model.embedding.dense_embeddings=0", "model.embedding.dense_hidden=[8]"],
            "dense_hidden is set but",
        ),
        (["data.synthetic.num_dense=0", "model.embedding.dense_hidden=[8]"], "the data has no dense feature"),
    ],
)
def test_an_embedding_key_nothing_reads_is_refused(overrides, words):
    """small_dim without small_dim_features, qr_op without qr_buckets, and dense_hidden without a dense MLP
    (dense_embeddings=0, or no dense feature) were dropped without a word."""
    with pytest.raises(ConfigError, match=words):
        load_config(CONFIGS / "demo.yaml", overrides)
    # With what reads them they are taken.
    used = ["model.embedding.small_dim=8", "model.embedding.small_dim_features=[s0]", "model.embedding.qr_op=add",
            "model.embedding.qr_buckets={s1: 4}", "model.embedding.dense_hidden=[8]"]  # fmt: skip
    load_config(CONFIGS / "demo.yaml", used)


@pytest.mark.parametrize("key", ["reduce_lr_factor=0.5", "restore_best=true"])
def test_an_early_stopping_action_patience_1_never_takes_is_refused(key):
    """reduce_lr_factor and restore_best act on an evaluation without improvement that does not stop the
    run; with patience 1 the first one stops it: they were dropped without a word."""
    es = ["train.early_stopping.patience=1", f"train.early_stopping.{key}"]
    with pytest.raises(
        ConfigError, match=rf"train\.early_stopping: {key.split('=')[0]} acts on .* patience 1"
    ):
        load_config(CONFIGS / "demo.yaml", es)
    load_config(CONFIGS / "demo.yaml", ["train.early_stopping.patience=2", f"train.early_stopping.{key}"])


@pytest.mark.parametrize(
    ("override", "key", "fix"),
    [
        ("data.synthetic.rows={train:1000, valid: 10}", "data.synthetic.rows.train:1000", "train: 1000"),
        ("model.embedding.qr_buckets={s0:4}", "model.embedding.qr_buckets.s0:4", "s0: 4"),
    ],
)
def test_a_colon_without_a_space_in_a_mapping_of_names_says_so(override, key, fix):
    """In a mapping of names YAML's {train:1000} is the key 'train:1000' without a value: the line said
    'Input should be a valid integer', as if 1000 were not one."""
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / "demo.yaml", [override])
    assert str(e.value) == (
        f"invalid config: {key}: a key without a value (YAML reads a colon without a space as part of the "
        f"key: write '{fix}')"
    )


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model.module_mlp=[64]"], "module_mlp is read by the mlp module only"),
        (["model.heads=4", "model.modules=[dot, linear]"], "heads is read by the self_attention module only"),
    ],
)
def test_a_dhen_key_of_a_module_it_does_not_run_is_refused(overrides, words):
    """DHEN's module_mlp sizes the mlp module (not in the default modules) and heads the self_attention one:
    without that module they were dropped without a word."""
    with pytest.raises(ConfigError, match=f"invalid config: model: {words}"):
        load_config(CONFIGS / "demo.yaml", ["model.name=dhen", *overrides])
    load_config(
        CONFIGS / "demo.yaml", ["model.name=dhen", "model.module_mlp=[64]", "model.modules=[mlp, dot]"]
    )


def test_a_wukong_k_with_the_full_fm_is_refused():
    """k is the optimized FM's width; with model.fm=full it was dropped without a word."""
    with pytest.raises(
        ConfigError, match="invalid config: model: k is the optimized FM's width, and fm is full"
    ):
        load_config(CONFIGS / "demo.yaml", ["model.fm=full", "model.k=4"])
    load_config(CONFIGS / "demo.yaml", ["model.fm=optimized", "model.k=4"])


def test_quant_gradients_without_a_lowered_layer_are_refused():
    """model.quant={gradients: true} with no format and no layers lowered nothing: the run trained in fp32."""
    with pytest.raises(
        ConfigError, match="invalid config: model.quant: gradients quantizes the output gradients"
    ):
        load_config(CONFIGS / "demo.yaml", ["model.quant={gradients: true}"])
    load_config(CONFIGS / "demo.yaml", ["model.quant={gradients: true, format: mxfp4}"])


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["data.synthetic.history_max_len=8"], "history_max_len is not read with num_history=0"),
        (["data.synthetic.history_alpha=2"], "history_alpha is not read with num_history=0"),
        (
            ["data.synthetic.teacher={kind: deep}", "data.synthetic.num_interactions=4"],
            "num_interactions is not read with the deep",
        ),
        (
            ["data.synthetic.interaction_order=1", "data.synthetic.num_interactions=4"],
            "num_interactions is not read with interaction_order=1",
        ),
    ],
)
def test_a_synthetic_key_another_leaves_unread_is_refused(overrides, words):
    """The history keys without a history field (num_history 0, the default), and the interaction teacher's
    with the deep teacher or linear terms only, were dropped without a word."""
    with pytest.raises(ConfigError, match=f"invalid config: data.synthetic: {words}"):
        load_config(CONFIGS / "demo.yaml", overrides)
    load_config(CONFIGS / "demo.yaml", ["data.synthetic.num_history=1", "data.synthetic.history_max_len=8"])


@pytest.mark.parametrize("towers", [0, -3])
def test_dmt_towers_below_one_are_refused_by_the_config(towers):
    """dmt.towers=0 passed the config and the launch then advised 'run it on 0 hosts (e.g. --nproc 0 ...)'."""
    with pytest.raises(
        ConfigError, match="dmt.towers: Input should be greater than or equal to 1, or .*'auto'"
    ):
        load_config(CONFIGS / "demo.yaml", [f"dmt.towers={towers}"])


def test_batch_norm_over_one_row_is_refused_before_training():
    """model.norm=batch with one row per (rank's) batch was 'internal error ValueError: Expected more than 1
    value per channel when training' at the first step."""
    from recscale.train.loop import check_world_size

    with pytest.raises(
        ConfigError, match="model.norm=batch normalises over the batch, and train.batch_size is 1"
    ):
        load_config(CONFIGS / "demo.yaml", ["model.norm=batch", "train.batch_size=1"])
    cfg = load_config(CONFIGS / "demo.yaml", ["model.norm=batch", "train.batch_size=2"])
    with pytest.raises(ConfigError, match="train.batch_size 2 over 2 ranks is 1 row each"):
        check_world_size(cfg, 2)
    check_world_size(cfg, 1)
    load_config(CONFIGS / "demo.yaml", ["train.batch_size=1"])  # the default model.norm (none) takes one row
