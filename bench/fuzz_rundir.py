"""Fuzz a run directory: nothing in it may execute code, or crash recscale, when it is loaded.

    python bench/fuzz_rundir.py --minutes 10 --out /tmp/fuzz        # prints a summary; exit 1 on a finding

Trains a tiny run (configs/demo.yaml, 2 steps) with the CLI, then again and again: copies it, mutates
one run file, and runs ``recscale eval RUN --data CSV --format csv`` (and now and then
``recscale train --resume --out RUN``) by calling ``recscale.cli.main`` in a forked child (fast:
torch is imported once; isolated: a hang is killed, memory is capped). Mutations:

- ``.metadata`` (DCP's pickle): byte flips, truncation, payloads spliced in (GLOBAL/STACK_GLOBAL +
  REDUCE of dangerous callables, dotted names included), and opcode-level edits of the real pickle
  (renamed globals, changed ints and strings, dropped/duplicated opcodes), plus object-level edits of
  the metadata (BytesStorageMetadata entries over pickled payloads, paths out of the checkpoint,
  negative or huge offsets);
  Half of the ``.metadata`` and ``state.json`` cases also drop the checkpoint's ``sha256.json``, so the
  mutations that pass the parsers reach DCP (a checkpoint of a version without the list loads unchecked);
- ``state.json`` / ``preprocess.json``: structural JSON edits (a node replaced by another type, keys
  dropped/added/renamed, markers, deep nesting, extreme numbers) and raw ones (truncation, flips,
  non-UTF-8);
- ``config.yaml``: the same structural edits, raw ones, and YAML python tags
  (``!!python/object/apply:os.system``...), aliases, odd scalars.

Every payload would create ``OUT/canary``. Per case it records the exit code, whether stderr was one
line starting with ``error:``, whether a traceback (or an "internal error": an exception the CLI did
not expect) appeared, a timeout, and whether the canary appeared; cases go to ``OUT/cases.jsonl``,
findings (with the mutated file) under ``OUT/findings/``. Exit status 1 on any canary hit, traceback,
internal error, multi-line error or timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import pickletools
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# Callables a payload may try to reach; "a.b" names are resolved through the module's globals by
# plain pickle (the dotted-name trick).
DANGEROUS = [
    ("os", "system"), ("posix", "system"), ("nt", "system"), ("builtins", "exec"), ("builtins", "eval"),
    ("builtins", "__import__"), ("builtins", "getattr"), ("builtins", "open"), ("subprocess", "getoutput"),
    ("subprocess", "Popen"), ("pickle", "loads"), ("torch", "load"), ("torch.serialization", "load"),
    ("torch._C", "_get_tracing_state"), ("torch", "_C._set_grad_enabled"),
    ("torch.distributed.checkpoint.filesystem", "os.system"),
    ("torch.distributed.checkpoint.metadata", "os.system"),
    ("torch.distributed.checkpoint.filesystem", "pickle.loads"),
    ("torch.distributed.checkpoint.default_planner", "torch.load"),
    ("pathlib", "os.system"), ("torch", "serialization.pickle.loads"), ("torch", "Size.__class__"),
    ("collections", "OrderedDict"), ("torch.serialization", "_get_layout.__globals__"),
]  # fmt: skip
YAML_TAGS = [
    "!!python/object/apply:os.system [{cmd!r}]",
    "!!python/object/apply:subprocess.getoutput [{cmd!r}]",
    "!!python/object/new:subprocess.Popen [[touch, {canary}]]",
    "!!python/name:os.system",
    "!!python/module:os",
    "!!python/object:os.system {{}}",
    "!!python/object/apply:builtins.exec [{py!r}]",
    "!!binary aGVsbG8=",
    "!!set {{a, b}}",
    "!!timestamp 2001-12-14t21:59:43.10-05:00",
    "!!float .nan",
    "!!int 0x7fffffffffffffffffff",
    "!!str",
    "&a [*a]",
]
ODD_JSON: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63) - 1, 2**70, 1e308, -1e-308, 0.5, float("nan"),
    "", "x" * 10_000, "../../etc/passwd", "/etc/passwd", "\u0000", "\ud7ff", [], {}, [[[[[]]]]],
    {"__tensor__": "/nope"}, {"__tensor__": 1}, {"__dict__": []}, {"__dict__": [["a"]]},
    {"__pickle__": "gASVAAAAAAAAAAB9lC4="}, {"py/object": "os.system"}, {"!!python/object/apply:os.system": []},
]  # fmt: skip


# ---------------------------------------------------------------- pickle opcode (de)assembly
def disassemble(data: bytes) -> list[tuple[str, Any]]:
    return [(op.name, arg) for op, arg, _ in pickletools.genops(data) if op.name != "FRAME"]


def _uni(s: str) -> bytes:
    b = s.encode("utf-8", "surrogatepass")
    return (b"\x8c" + bytes([len(b)]) + b) if len(b) < 256 else (b"X" + struct.pack("<I", len(b)) + b)


def _int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if 0 <= n < 65536:
        return b"M" + struct.pack("<H", n)
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    b = pickle.encode_long(n)  # type: ignore[attr-defined]
    return b"\x8a" + bytes([len(b)]) + b


def assemble(ops: list[tuple[str, Any]]) -> bytes:
    """Opcodes back to bytes, without frames (optional in protocol 4). Unknown ones keep no argument."""
    out = bytearray()
    for name, arg in ops:
        if name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            out += _uni(arg)
        elif name in ("BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG"):
            out += _int(arg)
        elif name == "PROTO":
            out += b"\x80" + bytes([arg & 0xFF])
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            out += b"h" + bytes([arg]) if 0 <= arg < 256 else b"j" + struct.pack("<I", arg & 0xFFFFFFFF)
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            out += b"q" + bytes([arg]) if 0 <= arg < 256 else b"r" + struct.pack("<I", arg & 0xFFFFFFFF)
        elif name == "BINFLOAT":
            out += b"G" + struct.pack(">d", arg)
        elif name in ("GLOBAL", "INST"):
            module, _, attr = arg.partition(" ")
            out += _OPS[name] + module.encode() + b"\n" + attr.encode() + b"\n"
        elif name == "EXT1":
            out += b"\x82" + bytes([arg])
        elif name in ("SHORT_BINBYTES", "BINBYTES"):
            out += (
                b"C" + bytes([len(arg)]) + arg if len(arg) < 256 else b"B" + struct.pack("<I", len(arg)) + arg
            )
        else:
            out += _OPS[name]
    return bytes(out)


_OPS = {op.name: op.code.encode("latin-1") for op in pickletools.opcodes}


def payload_ops(module: str, name: str, arg: Any, stack: bool) -> list[tuple[str, Any]]:
    fn = [("SHORT_BINUNICODE", module), ("SHORT_BINUNICODE", name), ("STACK_GLOBAL", None)]
    arg_ops = disassemble(pickle.dumps(arg, protocol=4))[1:-1]  # drop PROTO and STOP
    return [
        *(fn if stack else [("GLOBAL", f"{module} {name}")]),
        *arg_ops,
        ("TUPLE1", None),
        ("REDUCE", None),
    ]


# ---------------------------------------------------------------- mutations
class Mutator:
    def __init__(self, rng: random.Random, canary: Path, out: Path) -> None:
        self.rng, self.canary, self.out = rng, canary, out
        self.cmd = f"touch {canary}"
        self.py = f"open({str(canary)!r}, 'w').close()"

    def arg_for(self, name: str) -> Any:
        if name.endswith(("exec", "eval")):
            return self.py
        if name.endswith("loads"):
            return pickle.dumps(Reduce(os.system, self.cmd))
        if name.endswith("load"):
            return str(self.out / "evil.pkl")
        if name == "Popen":
            return ["touch", str(self.canary)]
        return self.cmd

    # .metadata ---------------------------------------------------
    def metadata(self, data: bytes, ckpt: Path) -> tuple[bytes, str]:
        r = self.rng
        kind = r.choice(
            ["flip", "truncate", "whole-payload", "splice", "ops", "ops", "ops", "object", "object"]
        )
        if kind == "flip":
            b = bytearray(data)
            for _ in range(r.randint(1, 8)):
                b[r.randrange(len(b))] = r.randrange(256)
            return bytes(b), kind
        if kind == "truncate":
            n = r.randrange(len(data))
            return data[:n], f"truncate to {n}"
        module, name = r.choice(DANGEROUS)
        stack = r.random() < 0.5
        if kind == "whole-payload":
            ops = [
                ("PROTO", 4),
                *payload_ops(module, name, self.arg_for(name), stack),
                ("STOP", None),
            ]
            return assemble(ops), f"payload {module}:{name} {'STACK_GLOBAL' if stack else 'GLOBAL'}"
        ops = disassemble(data)
        if kind == "splice":
            at = r.randrange(1, len(ops))
            ops[at:at] = payload_ops(module, name, self.arg_for(name), stack)
            if r.random() < 0.5:
                ops.insert(at + len(payload_ops(module, name, "", stack)) + 2, ("POP", None))
            return assemble(ops), f"splice {module}:{name} at op {at}"
        if kind == "ops":
            return self._edit_ops(ops)
        return self._edit_object(data, ckpt)

    def _edit_ops(self, ops: list[tuple[str, Any]]) -> tuple[bytes, str]:
        r = self.rng
        what = []
        for _ in range(r.randint(1, 3)):
            i = r.randrange(1, len(ops) - 1)
            name, arg = ops[i]
            choice = r.randrange(6)
            if choice == 0 and name in ("SHORT_BINUNICODE", "BINUNICODE"):
                module, attr = r.choice(DANGEROUS)
                new = r.choice([module, attr, "../" + arg, "/etc/passwd", arg + ".os.system", "", arg * 50])
                ops[i] = (name, new)
                what.append(f"str {arg[:30]!r}->{new[:30]!r}")
            elif choice == 1 and name in ("BININT", "BININT1", "BININT2", "LONG1"):
                new = r.choice([-1, 0, 2**31 - 1, 2**40, -(2**63), arg + 1, arg * 1000])
                ops[i] = ("BININT", new)
                what.append(f"int {arg}->{new}")
            elif choice == 2:
                del ops[i]
                what.append(f"drop {name}")
            elif choice == 3:
                ops.insert(i, ops[i])
                what.append(f"dup {name}")
            elif choice == 4:
                j = r.randrange(1, len(ops) - 1)
                ops[i], ops[j] = ops[j], ops[i]
                what.append(f"swap {name}/{ops[i][0]}")
            else:
                new_op = r.choice(["REDUCE", "BUILD", "NEWOBJ", "STACK_GLOBAL", "TUPLE2", "SETITEMS", "APPENDS",
                                   "EMPTY_DICT", "MARK", "POP", "NONE", "EXT1", "BINPERSID", "INST", "OBJ"])  # fmt: skip
                ops.insert(i, (new_op, {"EXT1": 1, "INST": "os system"}.get(new_op)))
                what.append(f"insert {new_op}")
        return assemble(ops), "ops " + "; ".join(what)

    def _edit_object(self, data: bytes, ckpt: Path) -> tuple[bytes, str]:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        r = self.rng
        md = pickle.loads(data)  # the base run's own metadata: trusted here
        keys = list(md.state_dict_metadata)
        infos = list(md.storage_data.values())
        choice = r.randrange(7)
        if choice == 0:  # an entry DCP would unpickle from the data file
            key = r.choice(keys)
            evil = ckpt / "__9_0.distcp"
            evil.write_bytes(pickle.dumps(Reduce(os.system, self.cmd)))
            md.state_dict_metadata[key] = BytesStorageMetadata()
            md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != key}
            md.storage_data[MetadataIndex(key)] = _StorageInfo(evil.name, 0, evil.stat().st_size)
            what = f"BytesStorageMetadata {key}"
        elif choice == 1:
            info = r.choice(infos)
            info.relative_path = r.choice(["../" + info.relative_path, "/etc/passwd", "..", "", "a/" + info.relative_path,
                                           "state.json", ".metadata", "../../preprocess.json"])  # fmt: skip
            what = f"relative_path {info.relative_path}"
        elif choice == 2:
            info = r.choice(infos)
            field = r.choice(["offset", "length"])
            setattr(info, field, r.choice([-1, -(2**40), 2**62, 0, "0", None, 1.5, True]))
            what = f"{field} {getattr(info, field)!r}"
        elif choice == 3:
            info = r.choice(infos)
            info.transform_descriptors = r.choice([["zstd"], ["evil"], "x", [1]])
            what = f"transform_descriptors {info.transform_descriptors!r}"
        elif choice == 4:
            key = r.choice(keys)
            md.state_dict_metadata[key] = r.choice(
                [None, 1, "x", Reduce(os.system, self.cmd), md.state_dict_metadata[key].properties]
            )
            what = f"entry {key} replaced"
        elif choice == 5:
            field = r.choice(
                ["state_dict_metadata", "storage_data", "planner_data", "storage_meta", "version"]
            )
            setattr(md, field, r.choice([None, [], {}, "x", 7, Reduce(os.system, self.cmd)]))
            what = f"Metadata.{field} replaced"
        else:
            entry = md.state_dict_metadata[r.choice(keys)]
            import torch

            entry.size = torch.Size([r.choice([-1, 0, 2**40])] * len(entry.size))
            what = f"size {entry.size}"
        return pickle.dumps(md), "object " + what

    # JSON ----------------------------------------------------------
    def json_text(self, text: str) -> tuple[bytes, str]:
        r = self.rng
        kind = r.choice(["structure", "structure", "structure", "raw"])
        if kind == "raw":
            return self.raw(text.encode())
        obj = json.loads(text)
        what = self._edit_tree(obj)
        if isinstance(what, tuple):
            obj, what = what
        return deepen(json.dumps(obj), r), "json " + what

    def _edit_tree(self, root: Any) -> str | tuple[Any, str]:
        r = self.rng
        nodes: list[tuple[Any, Any, str]] = []  # (container, key, path)

        def walk(o: Any, path: str, depth: int) -> None:
            if depth > 12 or len(nodes) > 5000:
                return
            items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else []
            for k, v in items:
                nodes.append((o, k, f"{path}/{k}"))
                walk(v, f"{path}/{k}", depth + 1)

        walk(root, "", 0)
        if not nodes or r.random() < 0.05:
            new = r.choice(ODD_JSON + [[root], "x"])
            return new, f"root -> {str(new)[:40]}"
        parent, key, path = r.choice(nodes)
        choice = r.randrange(6)
        if choice == 0:
            parent[key] = r.choice(ODD_JSON)
            return f"{path} = {str(parent[key])[:40]}"
        if choice == 1:
            del parent[key]
            return f"del {path}"
        if choice == 2 and isinstance(parent, dict):
            parent[r.choice(["__class__", "__tensor__", "__dict__", "__reduce__", "extra", key + "_"])] = (
                parent[key]
            )
            return f"add key beside {path}"
        if choice == 3:
            parent[key] = [parent[key]] if r.random() < 0.5 else {"v": parent[key]}
            return f"wrap {path}"
        if choice == 4:
            v = parent[key]
            parent[key] = (
                -v if isinstance(v, int | float) and not isinstance(v, bool)
                else v * r.choice([0, 2, 1000]) if isinstance(v, str | list) else not v if isinstance(v, bool)
                else None
            )  # fmt: skip
            return f"tweak {path}"
        parent[key] = DEEP  # spliced in as text: json/yaml cannot serialise a deep list themselves
        return f"deep nest at {path}"

    # YAML ----------------------------------------------------------
    def yaml_text(self, text: str) -> tuple[bytes, str]:
        import yaml

        r = self.rng
        kind = r.choice(["tag", "tag", "structure", "structure", "raw", "alias-bomb", "odd"])
        lines = text.splitlines()
        if kind == "tag":
            tag = r.choice(YAML_TAGS).format(cmd=self.cmd, py=self.py, canary=self.canary)
            i = r.randrange(len(lines))
            head, sep, _ = lines[i].partition(":")
            if sep:
                lines[i] = f"{head}: {tag}"
            else:
                lines.insert(i, f"evil: {tag}")
            return ("\n".join(lines) + "\n").encode(), f"yaml tag at line {i}: {tag[:50]}"
        if kind == "structure":
            obj = yaml.safe_load(text)
            what = self._edit_tree(obj)
            if isinstance(what, tuple):
                obj, what = what
            return deepen(yaml.safe_dump(obj, default_flow_style=True), r), "yaml " + what
        if kind == "alias-bomb":
            n = r.choice([5, 9])
            bomb = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
            bomb += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, n)]
            at = r.randrange(len(lines))
            key = lines[at].partition(":")[0] if ":" in lines[at] else "seed"
            return (
                text + "\n" + "\n".join(bomb) + f"\n{key.strip()}: *a{n - 1}\n"
            ).encode(), f"alias bomb {n} into {key}"
        if kind == "odd":
            odd = r.choice(["\t- tab", "key: [unclosed", "? complex\n: key", "<<: *undefined", "%YAML 9.9\n---",
                            "--- \n--- \n", "a: b\na: c", "\x00", "\ufeffseed: 0", "seed: 0 # " + "x" * 100_000,
                            "model: {name: !!python/name:builtins.print }", "train: !!set {x}",
                            "data: {format: " + "[" * 5000 + "}"])  # fmt: skip
            at = r.randrange(len(lines) + 1)
            lines.insert(at, odd)
            return "\n".join(lines).encode(), f"odd yaml {odd[:40]!r} at line {at}"
        return self.raw(text.encode())

    def raw(self, data: bytes) -> tuple[bytes, str]:
        r = self.rng
        choice = r.randrange(5)
        if choice == 0:
            n = r.randrange(len(data) + 1)
            return data[:n], f"raw truncate {n}"
        if choice == 1:
            b = bytearray(data)
            for _ in range(r.randint(1, 8)):
                b[r.randrange(len(b))] = r.randrange(256)
            return bytes(b), "raw flips"
        if choice == 2:
            at = r.randrange(len(data) + 1)
            return data[:at] + r.choice([b"\xff\xfe", b"\x00", b"\xed\xa0\x80", b"\xc3"]) + data[
                at:
            ], "raw invalid UTF-8"
        if choice == 3:
            return r.choice(
                [b"", b" ", b"\n", b"null", b"[]", b'"x"', b"0", b"\xef\xbb\xbf" + data]
            ), "raw replace"
        return data * r.choice([2, 50]), "raw repeated"


DEEP = "deep-nesting-goes-here"


def deepen(text: str, rng: random.Random) -> bytes:
    n = rng.choice([50, 500, 5000, 100_000])
    return text.replace(json.dumps(DEEP), "[" * n + "]" * n).replace(DEEP, "[" * n + "]" * n).encode()


class Reduce:
    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.fn, self.args


# ---------------------------------------------------------------- running one case
def run_case(argv: list[str], stdout: Path, stderr: Path, timeout: float) -> tuple[int | None, bool]:
    """``recscale.cli.main(argv)`` in a forked child: (exit code or None if killed, timed out)."""
    pid = os.fork()
    if pid == 0:  # child
        code = 99
        try:
            os.setsid()
            resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))  # a blow-up fails, not the box
            out = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            err = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(err, 2)
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            from recscale.cli import main

            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 70
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return (os.waitstatus_to_exitcode(status), False)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return (None, True)
        time.sleep(0.02)


def make_base(out: Path) -> tuple[Path, Path]:
    """A tiny trained run and a CSV of its columns."""
    run = out / "base" / "run"
    if not (run / "best" / ".metadata").is_file():
        shutil.rmtree(out / "base", ignore_errors=True)
        argv = [sys.executable, "-m", "recscale.cli", "train", str(REPO / "configs" / "demo.yaml"), "--out", str(run),
                "data.synthetic.rows={train: 500, valid: 100, test: 100}", "train.max_steps=2", "train.progress=false"]  # fmt: skip
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    from recscale.data.preprocess import Preprocessor

    schema = Preprocessor.load(run / "preprocess.json").schema
    multi, dense = {f.name for f in schema.sparse if f.multi}, set(schema.dense_names)
    cols = schema.column_names()
    rows = [",".join([str(i % 2)] + ["0.5" if c in dense else "1|2" if c in multi else str(i % 5) for c in cols[1:]])
            for i in range(20)]  # fmt: skip
    csv = out / "base" / "eval.csv"
    csv.write_text("\n".join([",".join(cols), *rows]) + "\n")
    return run, csv


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=90, help="seconds per case before it counts as a hang")
    p.add_argument("--resume-share", type=float, default=0.15, help="share of cases run as train --resume")
    args = p.parse_args()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    base, csv = make_base(out)
    canary = out / "canary"
    (out / "findings").mkdir(exist_ok=True)
    with open(out / "evil.pkl", "wb") as f:  # what a torch.load payload would be pointed at
        pickle.dump(Reduce(os.system, f"touch {canary}"), f)
    import recscale.cli  # noqa: F401  warm imports before forking: every child starts fast
    import recscale.train.loop  # noqa: F401

    targets = {
        "best/.metadata": 4, "best/state.json": 2, "preprocess.json": 3, "config.yaml": 3,
        "ckpt/step_00000002/.metadata": 1, "ckpt/step_00000002/state.json": 1,
    }  # fmt: skip
    deadline = time.monotonic() + args.minutes * 60
    stats: Counter[str] = Counter()
    findings: list[dict[str, Any]] = []
    log = open(out / "cases.jsonl", "w")
    i = 0
    while time.monotonic() < deadline:
        rng = random.Random(args.seed * 1_000_003 + i)
        work = out / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(base, work)
        canary.unlink(missing_ok=True)
        rel = rng.choices(list(targets), weights=list(targets.values()))[0]
        resume = rel.startswith("ckpt/") or rng.random() < args.resume_share  # eval reads best/ only
        path = work / rel
        m = Mutator(rng, canary, out)
        try:
            if rel.endswith(".metadata"):
                data, what = m.metadata(path.read_bytes(), path.parent)
            elif rel.endswith(".json"):
                data, what = m.json_text(path.read_text())
            else:
                data, what = m.yaml_text(path.read_text())
        except Exception as e:  # a mutation that could not be built: skip it, say so
            stats["mutation skipped"] += 1
            print(f"case {i}: mutation of {rel} failed ({type(e).__name__}: {e}); skipped", file=sys.stderr)
            i += 1
            continue
        path.write_bytes(data)
        if rel.endswith((".metadata", "state.json")) and rng.random() < 0.5:
            # Half the checkpoint cases without sha256.json (an older version's checkpoint, or an attacker's):
            # its sums would stop most mutations that pass the parsers before DCP reads the metadata.
            (path.parent / "sha256.json").unlink()
            what += " (sha256.json removed)"
        argv = (
            ["train", "--resume", "--out", str(work)]
            if resume
            else ["eval", str(work), "--data", str(csv), "--format", "csv"]
        )
        t0 = time.monotonic()
        code, timed_out = run_case(argv, out / "stdout.txt", out / "stderr.txt", args.timeout)
        err = (out / "stderr.txt").read_text(errors="replace")
        lines = err.strip().splitlines()
        error_lines = [line for line in lines if line.startswith("error: ")]
        rec = {
            "case": i, "file": rel, "mutation": what, "command": argv[0] + (" --resume" if resume else ""),
            "exit": code, "timeout": timed_out, "seconds": round(time.monotonic() - t0, 2),
            # eval: exactly one line; resume may say "resumed from ..." first; success may say nothing
            "one_line_error": code == 0 or (len(lines) == 1 or resume) and lines[-1:] == error_lines,
            "traceback": "Traceback (most recent call last)" in err, "internal_error": "internal error" in err,
            "canary": canary.exists(), "stderr": err[-2000:] if code not in (0, 2) or len(lines) > 1 else err[:300],
        }  # fmt: skip
        log.write(json.dumps(rec) + "\n")
        log.flush()
        stats["cases"] += 1
        stats[f"exit {code}"] += 1
        bad = [k for k in ("canary", "traceback", "internal_error", "timeout") if rec[k]]
        if not rec["one_line_error"] and not timed_out:
            bad.append("not one error line")
        if bad:
            for k in bad:
                stats[k] += 1
            findings.append(rec)
            keep = out / "findings" / f"{i:05d}"
            keep.mkdir(parents=True, exist_ok=True)
            (keep / rel.replace("/", "__")).write_bytes(data)
            (keep / "case.json").write_text(json.dumps(rec, indent=2))
            print(
                f"FINDING case {i} [{', '.join(bad)}] {rel}: {what} -> {lines[-1] if lines else ''}"[:400],
                flush=True,
            )
        elif i % 25 == 0:
            print(f"case {i}: {rel} {what[:60]} -> exit {code}", flush=True)
        i += 1
    log.close()
    shutil.rmtree(out / "work", ignore_errors=True)
    summary = {
        "cases": stats["cases"], "minutes": args.minutes, "seed": args.seed,
        "by_exit_code": {k: v for k, v in sorted(stats.items()) if k.startswith("exit ")},
        "canary_hits": stats["canary"], "crashes_with_traceback": stats["traceback"],
        "internal_errors": stats["internal_error"], "not_one_error_line": stats["not one error line"],
        "timeouts": stats["timeout"], "mutations_skipped": stats["mutation skipped"],
        "findings": [f"{f['case']} {f['file']}: {f['mutation']}" for f in findings][:50],
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    failed = (
        stats["canary"]
        + stats["traceback"]
        + stats["internal_error"]
        + stats["timeout"]
        + stats["not one error line"]
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
