"""Config files as dicts: YAML read into a mapping (one-line errors naming file:line:column), a
``base:`` config merged under the file that names it, dotted ``key=value`` overrides."""

from __future__ import annotations

import errno
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from recscale.errors import ConfigError


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading numbers with an exponent as YAML 1.2 does: ``1e-3`` and ``1e3`` are
    floats (YAML 1.1, which PyYAML follows, wants ``1.0e-3`` and reads them as strings, so ``max_steps: 1e3``
    was refused as 'unable to parse string as an integer'); a key given twice in one mapping is an error
    (PyYAML keeps the last silently: a second ``train:`` section, or a sweep family listed twice, would
    drop the first without a word)."""

    def compose_mapping_node(self, anchor: str | None) -> yaml.MappingNode:
        node = super().compose_mapping_node(anchor)
        # Checked on the composed node, before ``<<`` merges: a key that overrides a merged one is no repeat.
        first: dict[tuple[str, str], yaml.Mark] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            if (key.tag, key.value) in first:
                raise yaml.composer.ComposerError(
                    None, None,
                    f"key {key.value!r} repeats the one on line {first[key.tag, key.value].line + 1} of the "
                    "same mapping; keep one",
                    key.start_mark,
                )  # fmt: skip
            first[key.tag, key.value] = key.start_mark
        return node


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)[eE][-+]?\d+$"),
    list("-+.0123456789"),
)


def load_yaml(text: str | bytes) -> Any:
    """YAML text as Python data (safe: plain data only), numbers as YAML 1.2 reads them (``_Loader``)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def yaml_problem(e: yaml.YAMLError) -> str:
    """What the YAML parser expected, in a few words."""
    return getattr(e, "problem", None) or str(e).splitlines()[0]


def yaml_error(path: Path, e: yaml.YAMLError) -> str:
    """One line for a YAML syntax error: file:line:column and what the parser expected."""
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    return f"{where}: not valid YAML ({yaml_problem(e)}); fix the file's indentation or quoting there"


def not_a_file(path: Path, what: str) -> str:
    """The one line for ``what`` (say, "config file") at ``path``, which is no file: missing or a directory."""
    return f"{what} {path} {'is a directory; name a YAML file' if path.is_dir() else 'not found; check the path'}"


def read_yaml_mapping(path: Path, what: str = "a config") -> dict:
    """A YAML file that must hold a mapping; any problem is one ``ConfigError`` line naming the file."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file; check the path")
    try:
        data = path.read_bytes()
        # e.g. a Parquet data file given where the config goes (YAML in UTF-16 or -32 opens with a BOM)
        if b"\0" in data[:4096] and not data.startswith((b"\xff\xfe", b"\xfe\xff", b"\0\0\xfe\xff")):
            raise ConfigError(
                f"{path}: binary data, not a YAML file; {what} is a YAML file (a data file goes in data.train)"
            )
        raw = load_yaml(data)
    except yaml.YAMLError as e:
        raise ConfigError(yaml_error(path, e)) from None
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EIO):  # the disk's error, as itself: the file is not
            raise OSError(e.errno, e.strerror, str(path)) from None  # known to be bad (a run's "is corrupt")
        raise ConfigError(f"{path}: cannot be read as YAML ({type(e).__name__}: {str(e)[:120]})") from None
    except (RecursionError, ValueError) as e:  # absurdly nested, not text
        raise ConfigError(f"{path}: cannot be read as YAML ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: {what} must be a YAML mapping of sections (data, model, train)")
    return raw


def load_raw(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """A config file as a dict, with its ``base:`` (a config it extends, relative to the file)
    merged under it: mappings merge key by key, anything else is replaced. ``chain``: the files whose
    ``base:`` led here, outermost first (a file met again in it closes a cycle)."""
    path = Path(path)
    raw = read_yaml_mapping(path)
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must be the path of another config, got {base!r}")
    base_path = (path.parent / base).resolve()
    if not base_path.is_file():
        raise ConfigError(
            f"{path}: base {base}: no such file ({base_path}); fix the path, relative to this file"
        )
    chain = (*chain, path.resolve())
    if base_path in chain:
        cycle = " -> ".join(_shown(p) for p in (*chain[chain.index(base_path) :], base_path))
        raise ConfigError(
            f"{_shown(chain[-1])}: base {base} closes a cycle: {cycle}; remove one of these base: keys"
        )
    return merge(load_raw(base_path, chain), raw)


def _shown(path: Path) -> str:
    """``path`` relative to the working directory, or absolute where that would climb out of it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _index(node: list, part: str, what: str) -> int:
    """``part`` as an index into the list ``node``; ConfigError (naming ``what``) unless it is one."""
    if not part.isdecimal() or int(part) >= len(node):
        raise ConfigError(
            f"{what}: '{part}' is no index of its list of {len(node)} items; use 0 to {len(node) - 1}, "
            "or set the whole list"
        )
    return int(part)


def set_key(raw: dict, key: str, value: Any, what: str) -> None:
    """Set the dotted ``key`` of ``raw`` to ``value``: missing sections are created, list items are named by
    their index (``data.schema.sparse.0.min_count``); ``what`` (the override, say) names it in errors."""
    parts = key.split(".")
    if "" in parts:  # `train..max_steps` set a key '' that the schema named "train."
        raise ConfigError(f"{what}: write the key as its names joined by single dots, e.g. train.max_steps")
    node: dict | list = raw
    for i, p in enumerate(parts[:-1]):
        child = node[_index(node, p, what)] if isinstance(node, list) else node.setdefault(p, {})
        if not isinstance(child, dict | list):
            raise ConfigError(
                f"{what}: {'.'.join(parts[: i + 1])} is {child!r}, which has no keys; set it whole"
            )
        node = child
    if isinstance(node, list):
        node[_index(node, parts[-1], what)] = value
    else:
        node[parts[-1]] = value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Set dotted keys, e.g. ``train.max_steps=10``, and list items by index, e.g.
    ``data.schema.sparse.0.min_count=2`` (``set_key``); values are parsed as YAML."""
    if isinstance(overrides, str):  # a Python caller's one override, which iterating would split into letters
        raise ConfigError(
            f"overrides: give a list of key=value strings, e.g. [{overrides!r}], not one string"
        )
    for item in overrides:
        if re.search("[\udc80-\udcff]", item):  # bytes the locale did not decode (Python's surrogate escapes)
            shown = os.fsencode(item).decode("utf-8", "replace")
            raise ConfigError(
                f"override '{shown}' holds characters this locale's encoding ({sys.getfilesystemencoding()}) "
                "cannot read; run under a UTF-8 locale (e.g. LC_ALL=C.UTF-8) or set PYTHONUTF8=1"
            )
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}': write overrides as key=value, e.g. train.max_steps=100")
        try:
            parsed = load_yaml(value)
        except (yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: a date like 2020-13-01
            raise ConfigError(
                f"override '{item}': the value is not valid YAML ({yaml_problem(e)}); fix its brackets, or "
                "quote the whole override for the shell, e.g. 'data.synthetic.rows={train: 1000, valid: 100}'"
            ) from None
        if re.search(r"\s#", value) and not re.search(r"\s#", str(parsed)):
            # A path with ' #' in it (``data.train=/data/run #3/train.csv``) was cut to '/data/run' without a word
            raise ConfigError(
                f"override '{item}': ' #' starts a YAML comment, which cut the value to {parsed!r}; quote the "
                f"value (the quotes inside the shell's), e.g. '{key}=\"{value}\"'"
            )
        set_key(raw, key, parsed, f"override '{item}'")
    return raw
