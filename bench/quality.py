"""Quality benchmark: train each model on a dataset over several seeds; table next to published figures.

    python bench/quality.py bench/quality_frappe.yaml              # every model, seeds 0 1 2
    python bench/quality.py bench/quality_frappe.yaml --models wukong_auc dlrm --seeds 0

A suite file names, per model, what it trains: ``{config: RECIPE, overrides: [...]}`` (a run config,
e.g. configs/frappe/wukong.yaml, plus optional overrides), or a list of overrides of the suite's
``config``. Each run is the command ``recscale train CONFIG OVERRIDES seed=S``, printed as it starts, so
any row reproduces by hand. Runs go to runs/quality/<suite>/<model>/seed<S>; a finished run (report.json)
is not redone, and a run without a directory that trains the same config as a row of the last <out>.csv
is taken from there (so a changed model is rerun alone), unless the row's ``config_sha`` (the hash of
the config it trained) says its recipe has changed since. Writes <out>.csv (one row per run) and <out>.md
(mean ± std per model, published figures beside).
A suite with ``baseline: NAME`` adds each model's mean AUC relative to NAME's, in percent. An override
starting with ``--`` is an option of ``recscale train`` (e.g. ``--nproc=2``).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import yaml
from report_files import write_csv  # bench/ is on sys.path

from recscale.config import RunConfig, load_config, validate_config
from recscale.errors import ConfigError
from recscale.models.flops import mflop_number

REPO = Path(__file__).resolve().parents[1]


def entries(suite: dict) -> dict[str, tuple[str, list[str]]]:
    """Model -> (config, overrides) that the suite trains (before the seed)."""
    out = {}
    for model, entry in suite["models"].items():
        if isinstance(entry, list) and "config" in suite:  # overrides of the suite's config
            out[model] = (suite["config"], flatten(entry))
        elif isinstance(entry, dict) and "config" in entry and set(entry) <= {"config", "overrides"}:
            out[model] = (entry["config"], flatten(entry.get("overrides", [])))
        else:
            raise ConfigError(
                f"models.{model}: write {{config: FILE, overrides: [...]}}, or a list of overrides "
                "of the suite's config: FILE"
            )
    return out


def run_config(config: str, overrides: list[str]) -> RunConfig:
    """What ``recscale train CONFIG OVERRIDES`` trains as the suite runs it (options like --nproc aside)."""
    return load_config(REPO / config, ["train.progress=false", *(o for o in overrides if o[:2] != "--")])


def run_key(config: str, overrides: list[str]) -> str:
    """A run's resolved config and launcher options: equal for two commands that train the same thing,
    whether they name a recipe or spell its overrides out (as the tables before the recipes do)."""
    return run_config(config, overrides).to_yaml() + shlex.join(o for o in overrides if o[:2] == "--")


def config_sha(config: str, overrides: list[str]) -> str:
    """A short hash of what a command trains: stored with each row, it says what the row trained, even after
    the recipe its command names has changed. Fields at their defaults are left out, so a new config field
    (at its default: the old behaviour) does not make every row stale."""
    cfg = run_config(config, overrides).model_dump(mode="json", by_alias=True, exclude_defaults=True)
    text = yaml.safe_dump(cfg, sort_keys=True) + shlex.join(o for o in overrides if o[:2] == "--")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def recorded_rows(path: Path) -> dict[str, dict[str, str]]:
    """Rows of a table written before, by ``run_key`` of their command; a row whose stored ``config_sha``
    is not its command's now (the recipe changed since it trained) is stale and left out. Rows written
    before the column existed have none and cannot be checked."""
    if not path.is_file():
        return {}
    rows = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            _, _, config, *overrides = shlex.split(row["command"])
            try:
                key = run_key(config, overrides)
            except ConfigError:  # a config since removed or changed past validity: nothing can match it
                continue
            if row.get("config_sha") and row["config_sha"] != config_sha(config, overrides):
                continue
            rows[key] = row
    return rows


def run_one(config: str, overrides: list[str], out: Path) -> dict:
    report = out / "report.json"
    if report.is_file():  # reuse it only if it was trained with what the suite now says
        want = run_config(config, overrides)
        have = validate_config(yaml.safe_load((out / "config.yaml").read_text()))
        if want.model_dump() != have.model_dump():
            sys.exit(f"{out}: holds a run of another config (the suite changed since); delete it to rerun")
    else:
        cmd = ["recscale", "train", config, "--out", str(out), "train.progress=false", *overrides]
        print("$", shlex.join(cmd), flush=True)
        exe = Path(sys.executable).with_name("recscale")
        subprocess.run([str(exe), *cmd[1:]], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return json.loads(report.read_text())


def flatten(items: list) -> list[str]:
    """Overrides may nest one level (a shared YAML anchor inside a model's list)."""
    return [x for item in items for x in (item if isinstance(item, list) else [item])]


def published(reference: str | None) -> dict[str, dict[str, str]]:
    """Model name (lower case) -> row of the BARS reference CSV."""
    if not reference or not (REPO / reference).is_file():
        return {}
    with open(REPO / reference) as f:
        return {row["Model"].lower(): row for row in csv.DictReader(f)}


def from_csv(row: dict[str, str]) -> dict:
    """A row of a written table with its numbers parsed back."""
    ints = ("seed", "dense_params", "sparse_params", "steps", "best_step")
    floats = ("auc", "logloss", "ne", "mflops_per_example", "train_seconds")
    return {
        **row,
        **{k: int(row[k]) for k in ints},
        **{k: float(row[k]) for k in floats},
        "threads": int(row["threads"]) if row.get("threads") else None,
    }


def torch_version() -> str:
    import torch

    return torch.__version__


def cpu_model() -> str:
    """The CPU's model name and the instruction sets torch dispatches to (floating-point paths, so the last
    digits of a metric, differ between them; a virtual machine's model name alone can be just "AMD EPYC")."""
    import torch

    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    extra = sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})
    return f"{name} ({' '.join([torch.backends.cpu.get_cpu_capability(), *extra])})"


def mean_std(values: list[float], digits: int = 4) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", help="suite YAML: reference, models: {name: {config: FILE, overrides: [...]}}")
    ap.add_argument("--models", nargs="*", help="subset of the suite's models")
    ap.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    ap.add_argument("--out", help="output path prefix (default docs/quality_<suite>)")
    ap.add_argument("--rerun", nargs="*", default=[],
                    help="models to train again whatever the table holds (a row written before the config_sha "
                         "column cannot tell that its recipe changed)")  # fmt: skip
    args = ap.parse_args()

    suite_path = Path(args.suite)
    suite = yaml.safe_load(suite_path.read_text())
    name = suite_path.stem.removeprefix("quality_")
    models = entries(suite)
    chosen = args.models or list(models)
    if unknown := [m for m in chosen if m not in models]:
        ap.error(f"--models {' '.join(unknown)}: not in {args.suite}, whose models are {', '.join(models)}")
    out = Path(args.out) if args.out else REPO / "docs" / f"quality_{name}"
    ref = published(suite.get("reference"))
    extra_ref = suite.get("published", {})  # figures not in the BARS table (e.g. Wukong's paper)
    ref_names = suite.get("reference_names", {})  # our model name -> the reference table's, where they differ

    # Rows of the table written last time, by what they trained: a run whose directory is gone (runs/ is
    # not kept) is taken from there if the suite still trains the same config, so one model can be rerun
    # alone; the row gets the suite's command now, which trains that config.
    recorded = recorded_rows(out.with_suffix(".csv"))
    # Suites that report on data nothing was tuned on also record where each row ran, so a row that does
    # not reproduce elsewhere can be told apart from one that changed.
    record_machine = bool(suite.get("record_machine"))
    rows = []
    for model in chosen:
        config, overrides = models[model]
        for seed in args.seeds:
            seeded = [*overrides, f"seed={seed}"]
            command = shlex.join(["recscale", "train", config, *seeded])
            run_dir = REPO / "runs" / "quality" / name / model / f"seed{seed}"
            key = run_key(config, seeded)
            if model in args.rerun:
                shutil.rmtree(run_dir, ignore_errors=True)
            elif not (run_dir / "report.json").is_file() and key in recorded:
                old = recorded[key]  # rows from before the config_sha column keep it empty
                rows.append(
                    {
                        **from_csv(old),
                        "model": model,
                        "config_sha": old.get("config_sha", ""),
                        "command": command,
                    }
                )
                continue
            r = run_one(config, seeded, run_dir)
            # report.json writes a NaN metric (one-class labels, a diverged run) as null
            m = {k: float("nan") if v is None else v for k, v in r[suite.get("split", "valid")].items()}
            rows.append({
                "model": model, "seed": seed, "auc": m["auc"], "logloss": m["logloss"], "ne": m["ne"],
                "dense_params": r["parameters"]["dense"], "sparse_params": r["parameters"]["sparse"],
                "mflops_per_example": r["mflops_per_example"], "train_seconds": r["train_seconds"],
                "steps": r["steps"], "best_step": r["best_step"], "threads": r.get("torch_threads"),
                **({"torch": torch_version(), "cpu": cpu_model()} if record_machine else {}),
                "config_sha": config_sha(config, seeded), "command": command,
            })  # fmt: skip

    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out, rows)

    def mean_auc(model: str) -> float:
        return statistics.mean(r["auc"] for r in rows if r["model"] == model)

    base = suite.get("baseline") if suite.get("baseline") in chosen else None
    lines = [
        f"| model | AUC ({suite.get('split', 'valid')}) | {f'AUC vs {base} | ' if base else ''}LogLoss | NE "
        "| dense params | sparse params | MFLOP/ex | train s | published AUC | published LogLoss |",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if base else ""),
    ]
    for model in chosen:
        rs = [r for r in rows if r["model"] == model]
        pub = ref.get(ref_names.get(model, model).lower(), {}) or extra_ref.get(model, {})
        rel = f"{100 * (mean_auc(model) / mean_auc(base) - 1):+.2f}% | " if base else ""
        lines.append(
            f"| {model} | {mean_std([r['auc'] for r in rs])} | {rel}{mean_std([r['logloss'] for r in rs])} "
            f"| {mean_std([r['ne'] for r in rs])} | {rs[0]['dense_params']:,} | {rs[0]['sparse_params']:,} "
            f"| {mflop_number(rs[0]['mflops_per_example'])} | {mean_std([r['train_seconds'] for r in rs], 1)} "
            f"| {pub.get('AUC', '')} | {pub.get('Logloss', '')} |"
        )
    seeds = " ".join(map(str, args.seeds))
    # With its --out: without it, a rerun would write the suite's default table.
    cmd = f"python bench/quality.py {args.suite} --seeds {seeds}"
    cmd += f" --models {' '.join(chosen)}" if args.models else ""
    cmd += f" --out {args.out}" if args.out else ""
    text = "\n".join([*lines, "", f"Mean ± std over seeds {seeds}. Command: `{cmd}`"])
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    try:
        main()
    except ConfigError as e:
        sys.exit(f"error: {e}")
