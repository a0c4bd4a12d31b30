import errno
import os
import pickle
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from recscale.distributed.env import init_distributed, shutdown
from recscale.errors import CheckpointError, ResourceError, Terminated
from recscale.io import atomic_dir
from recscale.train.checkpoint import (
    join_state,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    split_state,
)


@pytest.fixture(scope="module", autouse=True)
def group():
    init_distributed()
    yield
    shutdown()


def state():
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)},
        "optim": {
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}],
            "state": {"w": {"step": torch.tensor(3.0)}},
        },
        "progress": {"epoch": 2, "best": None},
    }


def test_split_and_join_round_trip():
    tensors, plain = split_state(state())
    assert set(tensors) == {"/model/w", "/model/b", "/optim/state/w/step"}
    back = join_state(plain, tensors)
    assert back["optim"]["param_groups"][0]["betas"] == [0.9, 0.99]
    assert torch.equal(back["model"]["w"], state()["model"]["w"])


def test_save_load_round_trip(tmp_path):
    save_checkpoint(tmp_path / "step_00000001", state())
    template = state()
    template["model"]["w"].zero_()
    template["optim"]["state"]["w"]["step"].zero_()
    loaded = load_checkpoint(tmp_path / "step_00000001", template)
    assert torch.equal(loaded["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert loaded["optim"]["state"]["w"]["step"].item() == 3.0
    assert loaded["progress"] == {"epoch": 2, "best": None}


@pytest.mark.parametrize(
    ("error", "raised", "words"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), OSError, "No space left on device"),
        # torch's zip writer reports a write that came short (a full disk) as this
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
         CheckpointError, "could not be written ([enforce fail"),
    ],
)  # fmt: skip
def test_a_failed_write_is_an_error_naming_the_checkpoint(tmp_path, monkeypatch, error, raised, words):
    """DCP wraps a rank's write error in CheckpointException, a BaseException: it went past the CLI's
    handlers as a traceback. It is an ordinary error naming the checkpoint, and nothing is left of it."""
    from torch.distributed.checkpoint import FileSystemWriter

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(FileSystemWriter, "write_data", fail)
    path = tmp_path / "ckpt" / "step_00000001"
    with pytest.raises(raised) as e:
        save_checkpoint(path, state())
    assert str(path) in str(e.value) and words in str(e.value) and "\n" not in str(e.value)
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_a_write_past_the_file_size_limit_names_the_limit(tmp_path):
    """Under ``ulimit -f`` torch's zip writer fails as on a full disk ('unexpected pos'), with no errno: the
    line said only 'free space or fix the disk', with gigabytes free. It names the limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    big = {"model": {"w": torch.zeros(1 << 16)}}  # 256 KiB, past the limit below
    path = tmp_path / "ckpt" / "step_00000001"
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))  # Python ignores SIGXFSZ: writes fail EFBIG
    try:
        with pytest.raises(CheckpointError) as e:
            save_checkpoint(path, big)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(path) in str(e.value) and "65,536 bytes for this process (ulimit -f)" in str(e.value)
    assert "raise the limit" in str(e.value)
    assert list((tmp_path / "ckpt").iterdir()) == []


@pytest.mark.parametrize("stop", [KeyboardInterrupt, Terminated])
def test_ctrl_c_or_sigterm_inside_dcp_stops_as_itself(tmp_path, monkeypatch, stop):
    """DCP catches every BaseException in its write and read: a Ctrl-C or SIGTERM that landed there ended
    `recscale train` as 'the checkpoint could not be written (...); free space or fix the disk', or as a
    damaged checkpoint on a resume. It is raised as itself, and the unfinished checkpoint is gone."""
    from torch.distributed.checkpoint import FileSystemWriter

    from recscale.train.dcp_safety import SafeReader

    def interrupted(*args, **kwargs):
        raise stop

    path = tmp_path / "ckpt" / "step_00000001"
    with monkeypatch.context() as m:
        m.setattr(FileSystemWriter, "write_data", interrupted)
        with pytest.raises(stop):
            save_checkpoint(path, state())
    assert list((tmp_path / "ckpt").iterdir()) == []
    save_checkpoint(path, state())
    monkeypatch.setattr(SafeReader, "read_data", interrupted)
    with pytest.raises(stop):
        load_checkpoint(path, state())


@pytest.mark.parametrize(
    ("error", "words"),
    [
        # what torch's CPU allocator raised reading a 4-rank run's table shard under a memory limit
        (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                      "you tried to allocate 768000128 bytes. Error code 12 (Cannot allocate memory)"),
         "(the allocation that failed: 768,000,128 bytes)"),
        (MemoryError(), "out of memory reading the checkpoint;"),
    ],
)  # fmt: skip
def test_a_load_out_of_memory_is_not_called_damaged(tmp_path, monkeypatch, error, words):
    """DCP reads each saved tensor whole before copying it into this rank's shard: a resume that ran out of
    memory there said the intact checkpoint was damaged, inviting the user to delete it."""
    from recscale.train.dcp_safety import SafeReader

    path = tmp_path / "step_00000001"
    save_checkpoint(path, state())

    def out_of_memory(*args, **kwargs):
        raise error

    monkeypatch.setattr(SafeReader, "read_data", out_of_memory)
    with pytest.raises(ResourceError) as e:
        load_checkpoint(path, state())
    line = str(e.value)
    assert line.startswith(f"{path}: out of memory") and words in line and "\n" not in line
    assert "is not damaged" in line and "more ranks" in line


@pytest.mark.parametrize("code", [errno.EACCES, errno.EIO])
def test_a_data_file_that_cannot_be_read_is_not_called_damaged(tmp_path, monkeypatch, code):
    """A data file this user may not read (a run copied with mode 600 from another user) or a disk's read
    error said 'the checkpoint is damaged, or belongs to another model', inviting its deletion: it is the
    disk's error now, naming the file."""
    from recscale.train.dcp_safety import SafeReader

    path = tmp_path / "step_00000001"
    save_checkpoint(path, state())
    data = next(path.glob("*.distcp"))

    def unreadable(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(data))

    monkeypatch.setattr(SafeReader, "read_data", unreadable)
    with pytest.raises(OSError) as e:
        load_checkpoint(path, state())
    assert not isinstance(e.value, CheckpointError)
    assert e.value.errno == code and e.value.filename == str(data)


@pytest.mark.parametrize("name", [".metadata", "state.json"])
def test_a_metadata_or_state_file_that_cannot_be_read_is_not_called_damaged(tmp_path, monkeypatch, name):
    """As a data file: .metadata or state.json this user may not read said 'the checkpoint is damaged or was
    tampered with: restore it from a good copy or delete it'."""
    path = tmp_path / "step_00000001"
    save_checkpoint(path, state())
    real_open = os.open

    def no_permission(file, *args, **kwargs):
        if Path(file) == path / name:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_permission)
    with pytest.raises(OSError) as e:
        load_checkpoint(path, state())
    assert e.value.errno == errno.EACCES and e.value.filename == str(path / name)


class Evil:
    def __init__(self, canary):
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def test_tampered_metadata_is_refused_without_running_code(tmp_path):
    # More cases, the CLI and a fuzzer: tests/test_security.py, bench/fuzz_rundir.py.
    path = tmp_path / "step_00000001"
    save_checkpoint(path, state())
    (path / ".metadata").write_bytes(pickle.dumps(Evil(tmp_path / "canary")))
    with pytest.raises(CheckpointError, match="tampered"):
        load_checkpoint(path, state())
    assert not (tmp_path / "canary").exists()


def test_truncated_files_are_clear_errors(tmp_path):
    path = tmp_path / "step_00000001"
    save_checkpoint(path, state())
    meta = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(meta[: len(meta) // 2])
    with pytest.raises(CheckpointError):
        load_checkpoint(path, state())
    save_checkpoint(path, state())
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError):
        load_checkpoint(path, state())


def _flip_a_weight(path: Path) -> Path:
    """Change one byte of the saved ``w`` (arange(6.0): the float 5.0 is 00 00 a0 40) inside its data file."""
    data = next(path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    at = raw.index(bytes.fromhex("0000a040"))
    raw[at + 3] ^= 0x01  # 5.0 -> 5.0000005 (0x4140a000's neighbour): a plausible weight, valid file
    data.write_bytes(bytes(raw))
    return data


def test_a_changed_weight_is_refused_naming_its_file(tmp_path):
    """A flipped byte inside a tensor passed every check and loaded as a wrong weight (a run's eval gave
    LogLoss 4.8e35, exit 0): sha256.json lists every file's digest, and the file is refused before use."""
    path = tmp_path / "step_00000001"
    save_checkpoint(path, state())
    data = _flip_a_weight(path)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, state())
    assert str(e.value) == (
        f"{data}: its sha256 does not match sha256.json: it changed after it was saved; the checkpoint is "
        "damaged or was tampered with: restore it from a good copy or delete it"
    )


def test_a_changed_state_value_is_refused(tmp_path):
    path = tmp_path / "step_00000001"
    save_checkpoint(path, state())
    text = (path / "state.json").read_text()
    (path / "state.json").write_text(text.replace('"epoch", 2', '"epoch", 3'))
    assert (path / "state.json").read_text() != text  # still valid: only the sum tells
    with pytest.raises(CheckpointError, match=r"state\.json: its sha256 does not match sha256\.json"):
        load_checkpoint(path, state())


def test_a_checkpoint_without_checksums_loads_and_a_bad_list_is_refused(tmp_path):
    """Checkpoints of a recscale that wrote no sha256.json still load; a damaged list, or a data file it
    does not name, is refused."""
    path = tmp_path / "step_00000001"
    save_checkpoint(path, state())
    sums = (path / "sha256.json").read_text()
    (path / "sha256.json").unlink()
    assert load_checkpoint(path, state())["progress"] == {"epoch": 2, "best": None}
    (path / "sha256.json").write_text('{"sha256": {"state.json": "x"}}')
    with pytest.raises(CheckpointError, match="sha256.json: is not recscale's checksum list"):
        load_checkpoint(path, state())
    data = next(path.glob("*.distcp"))
    (path / "sha256.json").write_text(sums.replace(data.name, "__7_0.distcp"))
    with pytest.raises(CheckpointError, match=f"{data.name}: is not listed in sha256.json"):
        load_checkpoint(path, state())


def test_interrupted_write_leaves_no_checkpoint(tmp_path):
    class Boom(Exception):
        pass

    with pytest.raises(Boom), atomic_dir(tmp_path / "ckpt" / "step_00000005") as tmp:
        (tmp / "state.json").write_text("{}")
        raise Boom
    assert list_checkpoints(tmp_path / "ckpt") == []
    assert not any((tmp_path / "ckpt").iterdir())


def test_a_write_removes_what_killed_writes_to_its_path_left(tmp_path):
    """SIGKILL inside atomic_dir (no ``except`` runs) left its temporary, a whole export's copy, beside --out
    for good. The next write to that path removes those no live writer holds, and leaves the rest."""
    import fcntl

    def leave(name: str) -> Path:
        p = tmp_path / name
        p.mkdir()
        (p / "weights").write_bytes(b"x" * 100)
        os.utime(p, (time.time() - 3600,) * 2)
        return p

    killed, live, other = (
        leave(".model.abc_1234.tmp"),
        leave(".model.livewrtr.tmp"),
        leave(".model.x.abcd1234.tmp"),
    )
    young = tmp_path / ".model.youngone.tmp"
    young.mkdir()  # its writer may not have taken its lock yet
    # A writer at work holds its temporary's lock (flock: per open file, so this process's own fd counts).
    held = os.open(live, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        with atomic_dir(tmp_path / "model") as tmp:
            (tmp / "manifest.json").write_text("{}")
    finally:
        os.close(held)
    assert not killed.exists() and live.exists() and other.exists() and young.exists()
    assert (tmp_path / "model" / "manifest.json").exists()


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path / f"step_{step:08d}", state())
    prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]


def test_world_is_single_process():
    assert dist.get_world_size() == 1


@pytest.mark.parametrize(
    "key, why",
    [("momentum1", "one accumulator per row of each column shard"), ("w", "another model or config")],
)
def test_a_tensor_of_another_size_is_named_not_called_damaged(tmp_path, key, why):
    """A column-sharded run's row-wise Adagrad state has one row per row of each column shard: resumed
    at another world size it no longer fits, and DCP's message called the intact checkpoint damaged."""
    saved = {"model": {key: torch.zeros(4)}, "progress": {}}
    save_checkpoint(tmp_path / "step_00000001", saved)
    with pytest.raises(
        CheckpointError, match=rf"/model/{key} was saved with size \[4\], this run has \[2\]; .*{why}"
    ):
        load_checkpoint(tmp_path / "step_00000001", {"model": {key: torch.zeros(2)}, "progress": {}})


def test_the_rng_state_carries_a_gpus_generator(monkeypatch):
    """On a GPU dropout draws from the device's generator: only the CPU one was saved, so a resumed GPU run
    restarted its masks from the seed (the README calls a resume at the same world size exact)."""
    from recscale.train.state import rng_state, set_rng_state

    device = {"state": torch.arange(16, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: device["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: device.update(state=s))
    saved = rng_state()
    device["state"] = torch.zeros(16, dtype=torch.uint8)
    set_rng_state(saved)
    assert torch.equal(device["state"], torch.arange(16, dtype=torch.uint8))
    set_rng_state({"torch": saved["torch"]})  # a checkpoint from before, or from a CPU run: the CPU's only
