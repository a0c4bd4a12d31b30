"""Nothing in a run directory executes code on load (issue 18, item 1).

Every crafted file is built here (no binary blobs in the repository). Each payload, if it ran, would
create ``canary``; each case asserts a one-line ``CheckpointError`` naming the file, no canary, and a
run directory byte-identical before and after. The "live" controls prove the payloads are real: the
same bytes do run code under plain ``pickle`` / plain DCP.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import io
import json
import os
import pickle
import random
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from recscale.cli import main
from recscale.data.preprocess import Preprocessor
from recscale.data.schema import Schema, SparseFeature
from recscale.distributed.env import init_distributed, shutdown
from recscale.errors import CheckpointError, StaleArtifactError
from recscale.train import dcp_safety as safety
from recscale.train.checkpoint import load_checkpoint, save_checkpoint, split_state

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


@pytest.fixture(scope="module", autouse=True)
def group():
    init_distributed()
    yield
    shutdown()


# ---------------------------------------------------------------- helpers
def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root``: content hash, link target or file type (never opens a FIFO)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath, name)
            if p.is_symlink():
                out[str(p.relative_to(root))] = "link " + os.readlink(p)
            elif p.is_file():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[str(p.relative_to(root))] = oct(p.lstat().st_mode)
    return out


def refused(load: Callable[[], Any], names: Path, canary: Path, watch: Path) -> str:
    """Run ``load``; it must raise a one-line CheckpointError naming ``names``, run no payload and
    change nothing under ``watch``. Returns the message."""
    before = snapshot(watch)
    with pytest.raises(CheckpointError) as info:
        load()
    msg = str(info.value)
    assert "\n" not in msg and str(names) in msg, msg
    assert not canary.exists(), "a payload ran"
    assert snapshot(watch) == before
    return msg


def _unicode(s: str) -> bytes:
    b = s.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(b)) + b


def global_call(module: str, name: str, arg: str, opcode: bytes = pickle.STACK_GLOBAL) -> bytes:
    """A protocol-4 pickle calling ``module``.``name``(arg), resolved with STACK_GLOBAL or GLOBAL."""
    if opcode == pickle.GLOBAL:
        fn = pickle.GLOBAL + f"{module}\n{name}\n".encode()
    else:
        fn = _unicode(module) + _unicode(name) + pickle.STACK_GLOBAL
    return pickle.PROTO + b"\x04" + fn + _unicode(arg) + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP


class Reduce:
    """An object that pickles as ``fn(*args)``."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.fn, self.args


def state() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3, dtype=torch.float64)},
        "optim": {"state": {"w": {"step": torch.tensor(3, dtype=torch.int64)}}, "lr": [0.1, (0.9, 0.99)]},
        "progress": {"epoch": 2, "best": None, "name": "x"},
    }


@pytest.fixture
def canary(tmp_path) -> Path:
    return tmp_path / "canary"


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "run" / "ckpt" / "step_00000001"
    save_checkpoint(path, state())
    return path


def metadata(path: Path) -> Metadata:
    return pickle.loads((path / ".metadata").read_bytes())  # our own file: trusted here


# ---------------------------------------------------------------- the allowlist
def test_allowlist_covers_real_checkpoints_and_resolves_exactly(ckpt, trained_run):
    seen: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    for meta in [ckpt / ".metadata", *trained_run.glob("**/.metadata")]:
        Recorder(io.BytesIO(meta.read_bytes())).load()
    allowed = {*safety._ALLOWED_GLOBALS, ("builtins", "getattr")}  # _enum_member, on Python 3.11.2
    assert seen <= allowed, seen - allowed
    for (module, name), obj in safety._ALLOWED_GLOBALS.items():
        assert "." not in name and getattr(importlib.import_module(module), name) is obj


def test_good_checkpoint_still_loads(ckpt):
    template = state()
    template["model"]["w"].zero_()
    loaded = load_checkpoint(ckpt, template)
    assert torch.equal(loaded["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert loaded["optim"]["state"]["w"]["step"].item() == 3
    assert loaded["progress"] == {"epoch": 2, "best": None, "name": "x"}


def test_metadata_of_a_python_that_pickles_enums_by_name_loads(tmp_path, monkeypatch):
    """Python 3.11.2 (Debian 12's python3.11) pickles an Enum member as getattr(EnumClass, name): every
    checkpoint it wrote was refused on load ('forbidden global builtins getattr'), so each training failed at
    its end, loading best/. That form of TensorProperties' memory format loads now, and nothing else."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    with monkeypatch.context() as m:
        m.setattr(
            _MEM_FORMAT_ENCODING, "__reduce_ex__", lambda self, proto: (getattr, (type(self), self._name_))
        )
        save_checkpoint(tmp_path / "ckpt", state())
    assert b"getattr" in (tmp_path / "ckpt" / ".metadata").read_bytes()
    template = state()
    template["model"]["w"].zero_()
    assert torch.equal(
        load_checkpoint(tmp_path / "ckpt", template)["model"]["w"], torch.arange(6.0).reshape(2, 3)
    )


@pytest.mark.parametrize(
    "target, name",
    [(("pathlib", "PosixPath"), "write_text"), (("torch", "Size"), "__class__"),
     (("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"), "__class__")],
)  # fmt: skip
def test_getattr_names_nothing_but_a_memory_format(ckpt, canary, target, name):
    fn = _unicode("builtins") + _unicode("getattr") + pickle.STACK_GLOBAL
    payload = fn + _unicode(target[0]) + _unicode(target[1]) + pickle.STACK_GLOBAL + _unicode(name)
    (ckpt / ".metadata").write_bytes(
        pickle.PROTO + b"\x04" + payload + pickle.TUPLE2 + pickle.REDUCE + pickle.STOP
    )
    msg = refused(lambda: load_checkpoint(ckpt, state()), ckpt / ".metadata", canary, ckpt.parent.parent)
    assert "forbidden global 'builtins' 'getattr'" in msg


# ---------------------------------------------------------------- .metadata: code-execution payloads
def _cmd(canary: Path) -> str:
    return f"touch {canary}"


def _py(canary: Path) -> str:
    return f"open({str(canary)!r}, 'w').close()"


# (module, name, argument, runs code under plain pickle on Linux)
GLOBALS = [
    ("torch.distributed.checkpoint.filesystem", "os.system", _cmd, True),  # the reported exploit
    ("torch.distributed.checkpoint.metadata", "os.system", _cmd, True),
    ("pathlib", "os.system", _cmd, True),
    ("torch", "Size.__class__", _cmd, False),
    ("os", "system", _cmd, True),
    ("posix", "system", _cmd, True),
    ("nt", "system", _cmd, False),
    ("builtins", "eval", _py, True),
    ("builtins", "exec", _py, True),
    ("builtins", "__import__", _cmd, False),
    ("builtins", "getattr", _cmd, False),
    ("subprocess", "getoutput", _cmd, True),
    ("torch", "load", lambda c: str(c), False),
    ("torch.serialization", "load", lambda c: str(c), False),
    ("torch._C", "_get_tracing_state", _cmd, False),
    ("torch", "_C._set_grad_enabled", _cmd, False),
    ("collections", "OrderedDict", _cmd, False),
]


@pytest.mark.parametrize("opcode", [pickle.STACK_GLOBAL, pickle.GLOBAL], ids=["STACK_GLOBAL", "GLOBAL"])
@pytest.mark.parametrize("module, name, arg, live", GLOBALS, ids=[f"{m}:{n}" for m, n, _, _ in GLOBALS])
def test_dangerous_global_is_refused(ckpt, canary, module, name, arg, live, opcode):
    payload = global_call(module, name, arg(canary), opcode)
    if live:  # the same bytes do run code without the allowlist
        pickle.loads(payload)
        assert canary.exists()
        canary.unlink()
    (ckpt / ".metadata").write_bytes(payload)
    msg = refused(lambda: load_checkpoint(ckpt, state()), ckpt / ".metadata", canary, ckpt.parent.parent)
    assert "forbidden global" in msg


REDUCES: list[tuple[str, Callable[[Path], Any]]] = [
    ("os.system", lambda c: Reduce(os.system, _cmd(c))),
    ("builtins.exec", lambda c: Reduce(exec, _py(c))),
    ("builtins.eval", lambda c: Reduce(eval, _py(c))),
    ("subprocess.check_call", lambda c: Reduce(subprocess.check_call, ["touch", str(c)])),
    ("subprocess.Popen", lambda c: Reduce(subprocess.Popen, ["touch", str(c)])),
]


@pytest.mark.parametrize("hidden", [False, True], ids=["alone", "inside-real-metadata"])
@pytest.mark.parametrize("make", [m for _, m in REDUCES], ids=[i for i, _ in REDUCES])
def test_reduce_payload_is_refused(ckpt, canary, make, hidden):
    obj: Any = make(canary)
    if hidden:  # a valid checkpoint with the payload tucked into a field DCP never looks at
        md = metadata(ckpt)
        md.version = obj
        obj = md
    (ckpt / ".metadata").write_bytes(pickle.dumps(obj, protocol=4))
    refused(lambda: load_checkpoint(ckpt, state()), ckpt / ".metadata", canary, ckpt.parent.parent)


def test_bytes_entry_with_pickled_payload_is_refused(ckpt, canary, tmp_path):
    """DCP unpickles BytesStorageMetadata entries with torch.load(weights_only=False)."""
    (ckpt / "__9_0.distcp").write_bytes(pickle.dumps(Reduce(os.system, _cmd(canary))))
    md = metadata(ckpt)
    md.state_dict_metadata["/model/w"] = BytesStorageMetadata()
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != "/model/w"}
    md.storage_data[MetadataIndex("/model/w")] = _StorageInfo(
        "__9_0.distcp", 0, (ckpt / "__9_0.distcp").stat().st_size
    )
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    live = tmp_path / "live"
    shutil.copytree(ckpt, live)
    with pytest.raises(CheckpointException):  # plain DCP runs the payload (then fails on its None)
        dcp.load(split_state(state())[0], storage_reader=dcp.FileSystemReader(str(live)))
    assert canary.exists()
    canary.unlink()
    msg = refused(lambda: load_checkpoint(ckpt, state()), ckpt / ".metadata", canary, ckpt.parent.parent)
    assert "'/model/w'" in msg and "BytesStorageMetadata" in msg


def test_second_guard_planner_never_unpickles_bytes():
    item = type("Item", (), {"dest_index": MetadataIndex("/x")})()
    with pytest.raises(CheckpointError, match="pickled bytes"):
        safety.TensorsOnlyPlanner().load_bytes(item, io.BytesIO(pickle.dumps(1)))  # type: ignore[arg-type]


def test_build_cannot_set_attributes_on_an_allowed_class(ckpt, canary):
    # C pickle would run setattr(Metadata, "version", "x"): state (None, {slot: value}) on the class.
    payload = (
        pickle.PROTO + b"\x04" + _unicode("torch.distributed.checkpoint.metadata") + _unicode("Metadata")
        + pickle.STACK_GLOBAL + pickle.NONE + pickle.EMPTY_DICT + _unicode("version") + _unicode("x")
        + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.STOP
    )  # fmt: skip
    pickle.loads(payload)
    assert Metadata.version == "x"  # the gadget is real...
    Metadata.version = None
    (ckpt / ".metadata").write_bytes(payload)
    refused(lambda: load_checkpoint(ckpt, state()), ckpt / ".metadata", canary, ckpt.parent.parent)
    assert Metadata.version is None  # ...and refused here


OPCODES = {
    "EXT1": pickle.PROTO + b"\x04" + pickle.EXT1 + b"\x01" + pickle.STOP,
    "BINPERSID": pickle.PROTO + b"\x04" + _unicode("x") + pickle.BINPERSID + pickle.STOP,
    "INST": pickle.MARK + pickle.INST + b"os\nsystem\n" + pickle.STOP,
    "OBJ": pickle.MARK + pickle.GLOBAL + b"torch\nSize\n" + pickle.OBJ + pickle.STOP,
    "NEWOBJ_EX": pickle.PROTO + b"\x04" + pickle.GLOBAL + b"torch\nSize\n" + pickle.EMPTY_TUPLE
    + pickle.EMPTY_DICT + pickle.NEWOBJ_EX + pickle.STOP,
    "REDUCE-on-allowed-class-instance": pickle.PROTO + b"\x04" + pickle.GLOBAL + b"torch\nSize\n"
    + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.STOP,
    "NEWOBJ-of-Size": pickle.PROTO + b"\x04" + pickle.GLOBAL + b"torch\nSize\n" + pickle.EMPTY_TUPLE
    + pickle.NEWOBJ + pickle.STOP,
}  # fmt: skip


@pytest.mark.parametrize("payload", OPCODES.values(), ids=OPCODES.keys())
def test_opcodes_dcp_never_uses_are_refused(ckpt, canary, payload):
    (ckpt / ".metadata").write_bytes(payload)
    refused(lambda: load_checkpoint(ckpt, state()), ckpt / ".metadata", canary, ckpt.parent.parent)


# ---------------------------------------------------------------- .metadata: damaged or malformed
def _set_storage(field: str, value: Any) -> Callable[[Metadata], None]:
    def edit(md: Metadata) -> None:
        key = next(iter(md.storage_data))
        setattr(md.storage_data[key], field, value)

    return edit


def _set_entry(edit: Callable[[Any], None]) -> Callable[[Metadata], None]:
    return lambda md: edit(md.state_dict_metadata["/model/w"])


METADATA_EDITS: dict[str, Callable[[Metadata], None]] = {
    "path ../": _set_storage("relative_path", "../step_00000002/__0_0.distcp"),
    "path absolute": _set_storage("relative_path", "/etc/passwd"),
    "path subdir": _set_storage("relative_path", "sub/__0_0.distcp"),
    "path dotdot": _set_storage("relative_path", ".."),
    "path state.json": _set_storage("relative_path", "state.json"),
    "path missing file": _set_storage("relative_path", "__7_0.distcp"),
    "path not str": _set_storage("relative_path", 7),
    "offset negative": _set_storage("offset", -1),
    "offset str": _set_storage("offset", "0"),
    "offset bool": _set_storage("offset", True),
    "length negative": _set_storage("length", -5),
    "length beyond file": _set_storage("length", 1 << 40),
    "transform descriptors": _set_storage("transform_descriptors", ["zstd"]),
    "entry not metadata": lambda md: md.state_dict_metadata.__setitem__("/model/w", 5),
    "entry size negative": _set_entry(lambda e: setattr(e, "size", torch.Size([-2, 3]))),
    "entry chunk outside": _set_entry(lambda e: setattr(e.chunks[0], "offsets", torch.Size([5, 0]))),
    "entry chunk wrong rank": _set_entry(lambda e: setattr(e.chunks[0], "sizes", torch.Size([2]))),
    "entry field missing": _set_entry(lambda e: delattr(e, "chunks")),
    "state_dict_metadata list": lambda md: setattr(md, "state_dict_metadata", []),
    "storage_data None": lambda md: setattr(md, "storage_data", None),
    "storage key not index": lambda md: md.storage_data.__setitem__(
        "k", next(iter(md.storage_data.values()))
    ),
    "storage record missing": lambda md: md.storage_data.pop(
        next(k for k in md.storage_data if k.fqn == "/model/w")
    ),
    "planner_data list": lambda md: setattr(md, "planner_data", [1]),
    "version int": lambda md: setattr(md, "version", 3),
}


@pytest.mark.parametrize("edit", METADATA_EDITS.values(), ids=METADATA_EDITS.keys())
def test_malformed_metadata_is_refused(ckpt, canary, edit):
    md = metadata(ckpt)
    edit(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    refused(lambda: load_checkpoint(ckpt, state()), ckpt.parent / ckpt.name, canary, ckpt.parent.parent)


def _rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


RAW_METADATA: dict[str, Callable[[bytes], bytes]] = {
    "truncated half": lambda b: b[: len(b) // 2],
    "truncated to 1": lambda b: b[:1],
    "truncated by 1": lambda b: b[:-1],
    "empty": lambda b: b"",
    "random 0": lambda b: _rand(4096, 0),
    "random 1": lambda b: _rand(64, 1),
    "random after header": lambda b: b[:2] + _rand(2000, 2),
    "dict": lambda b: pickle.dumps({"state_dict_metadata": {}}),
    "list": lambda b: pickle.dumps([1, 2]),
    "None": lambda b: pickle.dumps(None),
    "str": lambda b: pickle.dumps("Metadata"),
    "json": lambda b: b'{"version": 1}',
    "protocol 0 dict": lambda b: pickle.dumps({}, protocol=0),
    "deep nesting": lambda b: pickle.PROTO + b"\x04" + pickle.EMPTY_LIST * 100_000 + pickle.STOP,
    "bad memo": lambda b: pickle.PROTO + b"\x04" + pickle.BINGET + b"\x07" + pickle.STOP,
    "lone surrogate": lambda b: pickle.PROTO + b"\x04" + pickle.SHORT_BINUNICODE + b"\x01\xff" + pickle.STOP,
}


@pytest.mark.parametrize("make", RAW_METADATA.values(), ids=RAW_METADATA.keys())
def test_damaged_metadata_is_refused(ckpt, canary, make):
    (ckpt / ".metadata").write_bytes(make((ckpt / ".metadata").read_bytes()))
    refused(lambda: load_checkpoint(ckpt, state()), ckpt / ".metadata", canary, ckpt.parent.parent)


def _oversized(path: Path, size: int) -> None:
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.truncate(size)  # sparse: costs no disk


def _swap_for_symlink(path: Path) -> None:
    outside = path.parent.parent.parent / f"outside-{path.name}"
    shutil.copyfile(path, outside)
    path.unlink()
    path.symlink_to(outside)


def _swap_for_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _swap_for_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


FILE_SWAPS: dict[str, Callable[[Path], None]] = {
    "oversized": lambda p: _oversized(p, safety.MAX_METADATA_BYTES + 1),
    "symlink out of the run": _swap_for_symlink,
    "dangling symlink": lambda p: (p.unlink(), p.symlink_to(p.parent / "nowhere")),
    "directory": _swap_for_dir,
    "fifo": _swap_for_fifo,
}


@pytest.mark.parametrize("name", [".metadata", "state.json"])
@pytest.mark.parametrize("swap", FILE_SWAPS.values(), ids=FILE_SWAPS.keys())
def test_unusual_files_are_refused(ckpt, canary, name, swap):
    swap(ckpt / name)
    refused(lambda: load_checkpoint(ckpt, state()), ckpt / name, canary, ckpt.parent.parent)


def test_data_file_symlink_and_truncation_are_refused(ckpt, canary):
    data = next(ckpt.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:100])
    refused(lambda: load_checkpoint(ckpt, state()), data, canary, ckpt.parent.parent)
    _swap_for_symlink(data)
    refused(lambda: load_checkpoint(ckpt, state()), data, canary, ckpt.parent.parent)


# ---------------------------------------------------------------- state.json
def _deep(n: int) -> str:
    return '{"__dict__": [["progress", ' + "[" * n + "]" * n + "]]}"


STATE_FILES: dict[str, str | bytes] = {
    "list": "[]",
    "string": '"state"',
    "number": "3",
    "null": "null",
    "no __dict__": '{"model": {}}',
    "__dict__ not list": '{"__dict__": "x"}',
    "pair too short": '{"__dict__": [["progress"]]}',
    "pair not list": '{"__dict__": [{"progress": 1}]}',
    "float key": '{"__dict__": [[1.5, 1]]}',
    "null key": '{"__dict__": [[null, 1]]}',
    "pickle marker": '{"__dict__": [["progress", {"__pickle__": "gASVAAAA"}]]}',
    "marker plus extra key": '{"__dict__": [["progress", {"__tensor__": "/x", "__class__": "os.system"}]]}',
    "tensor marker not str": '{"__dict__": [["progress", {"__tensor__": 5}]]}',
    "plain object": '{"__dict__": [["progress", {"epoch": 2}]]}',
    "nested 100": _deep(100),
    "nested 100000": _deep(100_000),
    "truncated": '{"__dict__": [["progress", {"__dict__": [["epoch", 2',
    "empty": "",
    "not UTF-8": b'{"__dict__": [["progress", "\xff\xfe"]]}',
    "UTF-16": '{"__dict__": []}'.encode("utf-16"),
    "NUL bytes": b"\x00" * 64,
    "huge int": '{"__dict__": [["progress", ' + "9" * 5000 + "]]}",
    "yaml tag": '!!python/object/apply:os.system ["touch /tmp/x"]',
}


@pytest.mark.parametrize("text", STATE_FILES.values(), ids=STATE_FILES.keys())
def test_malformed_state_json_is_refused(ckpt, canary, text):
    (ckpt / "state.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    refused(lambda: load_checkpoint(ckpt, state()), ckpt / "state.json", canary, ckpt.parent.parent)


def test_state_json_of_another_model_is_refused(ckpt, canary):
    (ckpt / "state.json").write_text('{"__dict__": [["model", {"__dict__": []}]]}')
    msg = refused(lambda: load_checkpoint(ckpt, state()), ckpt / "state.json", canary, ckpt.parent.parent)
    assert "does not match" in msg


# ---------------------------------------------------------------- preprocess.json
SCHEMA = Schema(
    sparse=[SparseFeature(name="a"), SparseFeature(name="b"), SparseFeature(name="h", hash_buckets=8)]
)


def _artifact(**edit: Any) -> dict[str, Any]:
    obj = Preprocessor(SCHEMA, {}).to_json() | {"version": 1}  # version 1's vocabularies, which still load
    obj["vocabs"] = {"a": {"type": "int", "values": [5, 7]}, "b": {"type": "str", "values": ["x", "y"]}}
    return {**obj, **edit}


def _vocab(**v: Any) -> dict[str, Any]:
    return _artifact(vocabs={"a": {"type": "int", "values": [5]}, "b": v})


def _offsets(*at: int) -> str:
    return base64.b64encode(np.array(at, "<i4").tobytes()).decode()


_V2_STR = {"type": "str", "offsets": _offsets(0, 1, 2), "text": ["xy"]}


def _v2(**v: Any) -> dict[str, Any]:
    return _artifact(version=2, vocabs={"a": {"type": "int", "ids": ""}, "b": {"type": "str", **v}})


def test_a_version_2_vocabulary_loads():
    pre = Preprocessor.from_json(_artifact(version=2, vocabs={"a": {"type": "int", "ids": ""}, "b": _V2_STR}))
    assert pre.vocabs["b"].to_pylist() == ["x", "y"] and pre.vocabs["a"].type == pa.int64()


ARTIFACTS: dict[str, Any] = {
    "list": [],
    "string": "preprocess",
    "number": 1,
    "null": None,
    "missing vocabs": {k: v for k, v in _artifact().items() if k != "vocabs"},
    "missing schema": {k: v for k, v in _artifact().items() if k != "schema"},
    "missing version": {k: v for k, v in _artifact().items() if k != "version"},
    "extra key": _artifact(__class__="os.system"),
    "version true": _artifact(version=True),
    "version str": _artifact(version="1"),
    "version 2 with version 1 vocabs": _artifact(version=2),
    "version 3": _artifact(version=3),
    "fingerprint not str": _artifact(fingerprint=5),
    "schema list": _artifact(schema=[]),
    "schema bad field": _artifact(schema={"sparse": [{"name": "a", "min_count": "x"}]}),
    "schema extra key": _artifact(schema={**SCHEMA.model_dump(), "python": "!!python/object"}),
    "vocabs list": _artifact(vocabs=[]),
    "vocab missing field": _artifact(vocabs={"a": {"type": "int", "values": []}}),
    "vocab unknown field": _artifact(vocabs={**_artifact()["vocabs"], "zz": {"type": "int", "values": []}}),
    "vocab for hashed field": _artifact(vocabs={**_artifact()["vocabs"], "h": {"type": "int", "values": []}}),
    "vocab type float": _vocab(type="float", values=[1.5]),
    "vocab type pickle": _vocab(type="pickle", values=["gASV"]),
    "vocab not object": _artifact(vocabs={"a": [1], "b": [2]}),
    "vocab extra key": _vocab(type="str", values=["x"], extra=1),
    "vocab values str": _vocab(type="str", values="xy"),
    "vocab values mixed": _vocab(type="str", values=["x", 1]),
    "vocab int values bool": _artifact(
        vocabs={"a": {"type": "int", "values": [True]}, "b": {"type": "str", "values": []}}
    ),
    "vocab int beyond int64": _artifact(
        vocabs={"a": {"type": "int", "values": [1 << 70]}, "b": {"type": "str", "values": []}}
    ),
    "vocab nested": _vocab(type="str", values=[["x"]]),
    # version 2: each vocabulary in a few strings
    "v2 ids not base64": _artifact(version=2, vocabs={"a": {"type": "int", "ids": "!!"}, "b": _V2_STR}),
    "v2 ids not 8 bytes each": _artifact(
        version=2, vocabs={"a": {"type": "int", "ids": "AAAA"}, "b": _V2_STR}
    ),
    "v2 ids a list": _artifact(version=2, vocabs={"a": {"type": "int", "ids": [5]}, "b": _V2_STR}),
    "v2 offsets short of the text": _v2(offsets=_offsets(0, 1), text=["xy"]),
    "v2 offsets past the text": _v2(offsets=_offsets(0, 3), text=["xy"]),
    "v2 offsets backwards": _v2(offsets=_offsets(0, 2, 1, 2), text=["xy"]),
    "v2 offsets not from 0": _v2(offsets=_offsets(1, 2), text=["xy"]),
    "v2 offsets empty": _v2(offsets="", text=[]),
    "v2 offsets split a character": _v2(offsets=_offsets(0, 1, 2), text=["\u00e9"]),
    "v2 text a string": _v2(offsets=_offsets(0, 2), text="xy"),
    "v2 text lone surrogate": _v2(offsets=_offsets(0, 1), text=["\ud800"]),
    "v2 extra key": _v2(offsets=_offsets(0, 2), text=["xy"], values=[]),
}
RAW_ARTIFACTS: dict[str, bytes] = {
    "empty": b"",
    "truncated": json.dumps(_artifact()).encode()[:40],
    "not UTF-8": b'{"version": 1, "schema": "\xff"}',
    "lone surrogate": json.dumps(_vocab(type="str", values=["\ud800"])).encode(),
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "huge int": b"9" * 5000,
    "yaml tag": b"!!python/object/apply:os.system ['touch canary']",
}


@pytest.mark.parametrize(
    "data",
    [json.dumps(v).encode() for v in ARTIFACTS.values()] + list(RAW_ARTIFACTS.values()),
    ids=[*ARTIFACTS, *RAW_ARTIFACTS],
)
def test_malformed_preprocess_json_is_refused(tmp_path, canary, data):
    path = tmp_path / "run" / "preprocess.json"
    path.parent.mkdir()
    path.write_bytes(data)
    refused(lambda: Preprocessor.load(path), path, canary, path.parent)


@pytest.mark.parametrize("swap", [_swap_for_dir, _swap_for_fifo, lambda p: _oversized(p, (1 << 30) + 1)],
                         ids=["directory", "fifo", "oversized"])  # fmt: skip
def test_unusual_preprocess_json_is_refused(tmp_path, canary, swap):
    path = tmp_path / "run" / "preprocess.json"
    path.parent.mkdir()
    path.write_text(json.dumps(_artifact()))
    swap(path)
    refused(lambda: Preprocessor.load(path), path, canary, path.parent)


def test_preprocess_fingerprint(tmp_path):
    path = tmp_path / "preprocess.json"
    pre = Preprocessor.from_json(_artifact())
    pre.save(path)
    assert "fingerprint" not in json.loads(path.read_text())  # no fingerprint: today's format
    assert Preprocessor.load(path).vocabs["a"].to_pylist() == [5, 7]
    with pytest.raises(StaleArtifactError):  # expected one, none stored
        Preprocessor.load(path, expect_fingerprint="abc")
    pre.save(path, fingerprint="abc")
    assert Preprocessor.load(path, expect_fingerprint="abc").fingerprint == "abc"
    assert Preprocessor.load(path).fingerprint == "abc"
    with pytest.raises(StaleArtifactError) as info:
        Preprocessor.load(path, expect_fingerprint="abd")
    assert isinstance(info.value, CheckpointError) and str(path) in str(info.value)
    with pytest.raises(CheckpointError) as missing:  # a missing file is not "stale"
        Preprocessor.load(tmp_path / "nope.json", expect_fingerprint="abc")
    assert not isinstance(missing.value, StaleArtifactError)


# ---------------------------------------------------------------- end to end through the CLI
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("trained") / "run"
    rows = "data.synthetic.rows={train: 500, valid: 100, test: 100}"
    assert (
        main(["train", str(DEMO), "--out", str(run), rows, "train.max_steps=2", "train.progress=false"]) == 0
    )
    return run


@pytest.fixture
def run(trained_run, tmp_path) -> tuple[Path, Path]:
    """A copy of the trained run, and a CSV of its columns to evaluate on."""
    shutil.copytree(trained_run, tmp_path / "run")
    schema = Preprocessor.load(trained_run / "preprocess.json").schema
    multi = {f.name for f in schema.sparse if f.multi}
    dense = set(schema.dense_names)
    cols = schema.column_names()
    lines = [",".join(cols)] + [
        ",".join(
            [str(i % 2)] + ["0.5" if c in dense else "1|2" if c in multi else str(i % 5) for c in cols[1:]]
        )
        for i in range(20)
    ]
    (tmp_path / "eval.csv").write_text("\n".join(lines) + "\n")
    return tmp_path / "run", tmp_path / "eval.csv"


def _eval(run: Path, data: Path) -> list[str]:
    return ["eval", str(run), "--data", str(data), "--format", "csv"]


def test_untampered_run_evaluates(run, capsys):
    assert main(_eval(*run)) == 0, capsys.readouterr().err


def _tamper_best_metadata(payload: Callable[[Path, Path], bytes]) -> Callable[[Path, Path], Path]:
    def tamper(run: Path, canary: Path) -> Path:
        target = run / "best" / ".metadata"
        target.write_bytes(payload(run / "best", canary))
        return target

    return tamper


def _bytes_entry(ckpt_dir: Path, canary: Path) -> bytes:
    (ckpt_dir / "__9_0.distcp").write_bytes(pickle.dumps(Reduce(os.system, _cmd(canary))))
    md = metadata(ckpt_dir)
    key = next(iter(md.state_dict_metadata))
    md.state_dict_metadata[key] = BytesStorageMetadata()
    md.storage_data[MetadataIndex(key)] = _StorageInfo(
        "__9_0.distcp", 0, (ckpt_dir / "__9_0.distcp").stat().st_size
    )
    return pickle.dumps(md)


def _storage_path(ckpt_dir: Path, canary: Path) -> bytes:
    md = metadata(ckpt_dir)
    for info in md.storage_data.values():
        info.relative_path = "../ckpt/step_00000002/" + info.relative_path
    return pickle.dumps(md)


def _write(rel: str, data: bytes) -> Callable[[Path, Path], Path]:
    def tamper(run: Path, canary: Path) -> Path:
        (run / rel).write_bytes(data)
        return run / rel

    return tamper


def _flip_middle_byte(run: Path, canary: Path) -> Path:
    """Damage, not an attack: one byte of best/'s data file changed (it loaded, and scored, as it was)."""
    data = next((run / "best").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    return data


def _state_value(run: Path, canary: Path) -> Path:
    """A value of best/state.json changed, the file still well-formed."""
    state = run / "best" / "state.json"
    text = state.read_text()
    state.write_text(text.replace('"step", ', '"step", 1'))
    assert state.read_text() != text
    return state


CLI_CASES: dict[str, Callable[[Path, Path], Path]] = {
    "flipped byte in a data file": _flip_middle_byte,
    "state.json value": _state_value,
    "dotted os.system": _tamper_best_metadata(
        lambda d, c: global_call("torch.distributed.checkpoint.filesystem", "os.system", _cmd(c))
    ),
    "reduce os.system": _tamper_best_metadata(lambda d, c: pickle.dumps(Reduce(os.system, _cmd(c)))),
    "reduce exec": _tamper_best_metadata(lambda d, c: pickle.dumps(Reduce(exec, _py(c)))),
    "reduce subprocess": _tamper_best_metadata(
        lambda d, c: pickle.dumps(Reduce(subprocess.call, ["touch", str(c)]))
    ),
    "GLOBAL torch.load": _tamper_best_metadata(
        lambda d, c: global_call("torch", "load", str(c), pickle.GLOBAL)
    ),
    "bytes entry": _tamper_best_metadata(_bytes_entry),
    "storage path ../": _tamper_best_metadata(_storage_path),
    "truncated metadata": _tamper_best_metadata(lambda d, c: (d / ".metadata").read_bytes()[:999]),
    "state.json marker": _write("best/state.json", b'{"__dict__": [["model", {"__pickle__": "x"}]]}'),
    "preprocess.json list": _write("preprocess.json", b"[]"),
    "preprocess.json not UTF-8": _write("preprocess.json", b'{"version": "\xff"}'),
}


@pytest.mark.parametrize("tamper", CLI_CASES.values(), ids=CLI_CASES.keys())
def test_tampered_run_is_refused_by_eval(run, canary, capsys, tamper):
    run_dir, data = run
    target = tamper(run_dir, canary)
    before = snapshot(run_dir)
    code = main(_eval(run_dir, data))
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert str(target) in err and "Traceback" not in err
    assert not canary.exists()
    assert snapshot(run_dir) == before


def test_tampered_checkpoint_is_refused_by_resume(run, canary, capsys):
    run_dir, _ = run
    target = sorted((run_dir / "ckpt").iterdir())[-1] / ".metadata"
    target.write_bytes(global_call("torch.distributed.checkpoint.filesystem", "os.system", _cmd(canary)))
    before = snapshot(run_dir)
    code = main(["train", "--resume", "--out", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert str(target) in err
    assert not canary.exists()
    assert snapshot(run_dir) == before
