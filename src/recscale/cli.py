"""The ``recscale`` command: parse, load the config, call into the packages. Nothing else lives here."""

from __future__ import annotations

import argparse
import codecs
import errno
import io
import json
import math
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import NoReturn

from recscale.errors import RecscaleError, Terminated
from recscale.quiet import quiet_upstream

LOST_PEER_EXIT = 3  # the exit code of a rank that failed because another rank did


def _fmt(v: object) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def print_report(report: dict) -> None:
    from recscale.models.flops import mflop_text
    from recscale.train.metrics import undefined_note

    lines = [f"model {report['model']}  ·  {report['steps']} steps  ·  {report['examples_per_s']} examples/s"]
    p = report["parameters"]
    lines.append(f"parameters: dense {p['dense']:,}  sparse {p['sparse']:,}  ·  "
                 f"{mflop_text(report['mflops_per_example'])}/example (forward)")  # fmt: skip
    notes = []
    for split in ("valid", "report", "test"):  # report: valid's held-out half (data.report_fraction)
        if split in report:
            m = report[split]
            lines.append(
                f"{split:6s} "
                + "  ".join(
                    f"{k} {_fmt(m[k])}"
                    for k in ("auc", "logloss", "ne", "calibration", "gauc", "rows")
                    if k in m
                )
            )
            if (note := undefined_note(m)) is not None:
                notes.append(f"note: {split} {note}")
    if not any(split in report for split in ("valid", "report", "test")):
        notes.append("note: the run has no valid or test split, so nothing was evaluated and the last step's "
                     "weights are kept; give data.valid (or data.valid_fraction, or data.test) to measure the model")  # fmt: skip
    lines += notes
    if "bayes_logloss" in report:
        # ne is left out where undefined (a split of one class), as the note above the line says of the split's
        ne = f"  ne {_fmt(report['bayes_ne'])}" if math.isfinite(report["bayes_ne"]) else ""
        lines.append(f"Bayes floor (synthetic teacher): logloss {_fmt(report['bayes_logloss'])}{ne}")
    if report.get("skipped_rows"):
        lines.append(
            "skipped bad rows: " + ", ".join(f"{k} {v:,}" for k, v in report["skipped_rows"].items())
        )
    if report.get("truncated_sequences"):
        lines.append(f"sequences cut to max_len (rows): {report['truncated_sequences']}")
    lines.append(f"run directory: {report['run_dir']}")
    print("\n".join(lines))


def diverged_line(report: dict) -> str:
    """Why a training that diverged (report ``diverged_at_step``) failed, and what to change."""
    kept = report["best_step"] < report["diverged_at_step"]
    scored = (
        f"the report scores the best model, of step {report['best_step']}"
        if kept
        else "nothing usable was kept"
    )
    return (
        f"training diverged: its loss was NaN or infinite by step {report['diverged_at_step']}, where it stopped "
        f"({scored}); lower the learning rates (train.dense_optimizer.lr, train.sparse_optimizer.lr) and train again"
    )


def cmd_train(args: argparse.Namespace) -> None:
    from recscale.config import load_config
    from recscale.distributed.dmt.assignment import resolve_assignment
    from recscale.distributed.dmt.build import check_topology
    from recscale.distributed.env import shutdown
    from recscale.distributed.launch import host_split
    from recscale.distributed.topology import Topology
    from recscale.train.build import check_model
    from recscale.train.loop import Trainer, check_run_dir, check_world_size
    from recscale.train.runs import resume_config

    if args.resume and args.config is not None and "=" in args.config and not Path(args.config).is_file():
        args.overrides.insert(0, args.config)  # `train --resume --out RUN k=v`: the first override
        args.config = None
    if args.resume and not args.out:
        raise RecscaleError("train --resume: name the run to continue with --out RUN_DIR")
    if args.config is None and not args.resume:
        raise RecscaleError("train: give a CONFIG file (or --resume --out RUN_DIR)")
    out = Path(args.out) if args.out else Path("runs") / Path(args.config).stem
    if out.exists() and not out.is_dir():
        raise RecscaleError(f"--out {out} is a file; name a directory for the run (it is created if missing)")
    if args.resume:  # checked before anything is launched or written: a refused resume changes nothing
        cfg = resume_config(out, args.config, args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
    if args.nproc is not None:  # checked once, here, rather than by every rank after the launch
        hosts, local = host_split(args.nproc, args.local_world_size)
        check_world_size(cfg, args.nproc)
        if cfg.dmt is not None:
            check_topology(cfg, hosts)
            # An assignment of other features (another run's partition file): each rank said it after the launch.
            resolve_assignment(cfg.dmt.assignment, [f.name for f in cfg.data.schema.sparse], hosts, cfg.seed)
        check_model(cfg)
        check_run_dir(out, cfg, args.resume, Topology(args.nproc, local))
        try:
            with _sigterm_raises():  # the launcher stops its ranks, which die of the SIGTERM it sends them
                _launch(args, out)
        except (Terminated, KeyboardInterrupt) as e:
            raise _stopped(e, args, out, None) from None
        return
    if args.local_world_size is not None or args.max_restarts:
        raise RecscaleError("train: --local-world-size and --max-restarts go with --nproc")
    trainer: Trainer | None = None
    try:
        with _sigterm_raises():
            trainer = Trainer(cfg, out, resume=args.resume)
            report = trainer.fit()
            if trainer.main:
                print_report(report)
            if "diverged_at_step" in report:
                raise RecscaleError(diverged_line(report))
    except (Terminated, KeyboardInterrupt) as e:
        shutdown()
        raise _stopped(e, args, out, trainer.progress.step if trainer is not None else None) from None
    shutdown()  # joins gloo's threads: left to exit-time destructors they can abort the process


def _stop(e: BaseException, line: str) -> BaseException:
    """What ends a command that SIGTERM (``Terminated``) or Ctrl-C (``KeyboardInterrupt``) stopped: the same
    exception, saying ``line``, in which ``{by}`` names the signal (main prints it; exit 143 or 130)."""
    if isinstance(e, KeyboardInterrupt):
        return KeyboardInterrupt(line.format(by="Ctrl-C"))
    return Terminated(line.format(by="SIGTERM"))


def _stopped(e: BaseException, args: argparse.Namespace, out: Path, step: int | None) -> BaseException:
    """The line of a training into ``out`` that SIGTERM or Ctrl-C stopped (at ``step``, where known): how to go
    on."""
    from recscale.train.checkpoint import list_checkpoints

    at = f" at step {step}" if step is not None else ""
    ckpts = list_checkpoints(out / "ckpt")
    if not ckpts:
        return _stop(
            e, f"train: stopped by {{by}}{at}, before its first checkpoint; run the same command again"
        )
    again = ["recscale", "train", "--resume", "--out", str(out)]
    if args.nproc is not None:  # the same ranks and hosts: a DMT run resumes only there
        again += ["--nproc", str(args.nproc)]
        again += ["--local-world-size", str(args.local_world_size)] if args.local_world_size else []
    return _stop(e, f"train: stopped by {{by}}{at}; continue from {ckpts[-1]} with `{shlex.join(again)}`")


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` in the block (the first one: a second ends the process at once). Not in a
    rank of --nproc or torchrun: its launcher stops it with SIGTERM and needs it gone then, its own line
    being the job's one line."""
    if "RANK" in os.environ or threading.current_thread() is not threading.main_thread():
        yield
        return

    received = False

    def raise_terminated(signum: int, frame: FrameType | None) -> NoReturn:
        nonlocal received
        received = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    except Terminated:
        raise
    except BaseException as e:
        # Raised inside a library's callback, Terminated can come out as the library's own error (pydantic's
        # serializer: "PydanticSerializationError: ... Terminated"); the SIGTERM is still what ended the block.
        if received:
            raise Terminated from e
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if received:  # a library caught it and went on: the command was still asked to stop
        raise Terminated


def _launch(args: argparse.Namespace, out: Path) -> None:
    """Re-run this command as --nproc local processes (see recscale.distributed.launch)."""
    from recscale.distributed.launch import launch

    if "RANK" in os.environ:
        raise RecscaleError("train: --nproc starts its own processes; under torchrun leave it out")
    worker = ["-m", "recscale.cli", *(["--debug"] if args.debug else []), "train"]
    worker += [*([args.config] if args.config else []), *args.overrides]
    worker += ["--out", str(out), *(["--resume"] if args.resume else [])]
    launch(worker, args.nproc, args.local_world_size, args.max_restarts)


def cmd_eval(args: argparse.Namespace) -> None:
    from recscale.io import strict_json
    from recscale.train.metrics import undefined_note
    from recscale.train.runs import eval_run

    if args.split is not None:  # the run's own rows: no file, so nothing of how to read one
        given = [f for f, v in (("--data", args.data), ("--format", args.format), ("--on-bad-row", args.on_bad_row),
                                ("--predictions", args.predictions), ("--nproc", args.nproc)) if v is not None]  # fmt: skip
        if given or args.overrides:
            raise RecscaleError(
                f"eval --split {args.split} scores the run's own {args.split} rows, which {given[0] if given else 'a reader override'} "
                "does not apply to; leave it out, or score a file with --data"
            )
    if args.nproc is not None:
        _launch_scoring(args)
        return
    with _scoring_stops(args.command):
        metrics = eval_run(
            Path(args.run_dir),
            args.data,
            args.format,
            on_bad_row=args.on_bad_row,
            overrides=args.overrides,
            group_by=args.group_by,
            predictions=Path(args.predictions) if args.predictions else None,
            own_split=args.split,
        )
    if int(os.environ.get("RANK", 0)) != 0:  # each rank of --nproc or torchrun scored alike: rank 0 says it
        return
    print(strict_json(metrics))
    if (note := undefined_note(metrics)) is not None:  # beside the JSON, which stays one line
        print(f"note: {note}", file=sys.stderr)
    _note_unknown_ids(metrics.get("unknown_id_fields"))


def _note_unknown_ids(unknown: list[str] | None) -> None:
    """eval's and predict's note on the fields none of whose ids the run knows (their scores are OOV's)."""
    if unknown:
        print(
            f"note: no id of {', '.join(unknown)} is in the run's vocabularies (every row OOV or missing); "
            "check that the file writes ids as the training data did (e.g. not 007 for 7)",
            file=sys.stderr,
        )


@contextmanager
def _scoring_stops(command: str) -> Iterator[None]:
    """SIGTERM stops ``eval`` or ``predict`` as Ctrl-C does: the file's materialised copy in a temporary
    directory (as large as the split) is removed, not left behind by a process dead of the signal."""
    if "RANK" in os.environ:  # a rank of --nproc or torchrun: it dies of its launcher's SIGTERM, as the
        # launcher expects (_sigterm_raises), once the blocks it is in have removed the copy

        def unwind(signum: int, frame: FrameType | None) -> NoReturn:
            raise Terminated

        previous = signal.signal(signal.SIGTERM, unwind)
        try:
            yield
        except Terminated:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
        finally:
            signal.signal(signal.SIGTERM, previous)
        return
    try:
        with _sigterm_raises():
            yield
    except Terminated:  # the process group, if one was started, ended with the scoring (own_group)
        raise Terminated(f"{command}: stopped by SIGTERM before it finished; nothing was written") from None


def _launch_scoring(args: argparse.Namespace) -> None:
    """``eval`` or ``predict`` as --nproc local ranks, each holding its share of the tables (see
    recscale.distributed.launch)."""
    from recscale.distributed.launch import launch
    from recscale.train.runs import check_scoring_args, check_scoring_ranks, run_config

    if "RANK" in os.environ:
        raise RecscaleError(f"{args.command}: --nproc starts its own processes; under torchrun leave it out")
    # Before the launch, not by every rank after it (each said it, "the other ranks were stopped").
    out = args.predictions if args.command == "eval" else args.out
    flag = "--predictions" if args.command == "eval" else "--out"
    run_dir = Path(args.run_dir)
    check_scoring_args(run_dir, args.data, args.overrides, (Path(out), flag) if out else None, args.command)
    check_scoring_ranks(run_config(run_dir), run_dir, args.nproc)
    worker = ["-m", "recscale.cli", *(["--debug"] if args.debug else []), args.command, args.run_dir]
    for flag in ("--data", "--format", "--on-bad-row", "--group-by", "--predictions", "--out"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        worker += [flag, value] if value is not None else []
    # SIGTERM: the ranks stopped, then one line and 143 as with one process.
    with _scoring_stops(args.command):
        launch([*worker, *args.overrides], args.nproc, None, 0)


def cmd_predict(args: argparse.Namespace) -> None:
    from recscale.train.runs import predict_run

    if args.nproc is not None:
        _launch_scoring(args)
        return
    with _scoring_stops(args.command):
        done = predict_run(
            Path(args.run_dir), args.data, Path(args.out), args.format, args.on_bad_row, args.overrides
        )
    if int(os.environ.get("RANK", 0)) != 0:  # each rank of --nproc or torchrun scored alike: rank 0 says it
        return
    skipped = f" ({done['skipped_rows']:,} bad rows dropped)" if done.get("skipped_rows") else ""
    print(f"scored {done['rows']:,} row{'s' * (done['rows'] != 1)}{skipped}: {args.out}")
    _note_unknown_ids(done.get("unknown_id_fields"))


def cmd_export(args: argparse.Namespace) -> None:
    from recscale.serve.export import export_run

    manifest = export_run(Path(args.run_dir), Path(args.out), args.tables, args.dense)  # its group ended
    size = sum(f.bytes for f in manifest.files.values())
    print(
        f"exported {manifest.model} (tables {manifest.tables}, dense {manifest.dense}, {size:,} bytes): {args.out}"
    )


def cmd_serve(args: argparse.Namespace) -> None:
    import socket

    from recscale.serve.server import ServeOptions, build_app, serve

    try:  # bound before the model loads: a taken port is found at once, as one line; 0 picks a free one
        sock = socket.create_server((args.host, args.port))
    except OSError as e:
        raise RecscaleError(
            f"serve: cannot listen on {args.host}:{args.port} ({e.strerror or e}); choose another --port or --host"
        ) from None
    opts = ServeOptions(
        args.max_batch,
        args.max_wait_ms,
        not args.no_batching,
        args.threads,
        args.max_body_kb << 10,
        args.workers,
        args.torch_threads,
    )
    with sock:
        app, what = build_app(Path(args.model_dir), args.max_rows, opts)
        port = sock.getsockname()[1]
        print(f"serving {what} from {args.model_dir} on http://{args.host}:{port} (Ctrl-C stops)", flush=True)
        # With several workers each loads its own model; this process only checked that it loads, and
        # lets it go rather than hold a model it never serves.
        served = app if opts.workers == 1 else None
        del app
        serve(served, Path(args.model_dir), args.max_rows, sock, opts)


def cmd_retrieval_build(args: argparse.Namespace) -> None:
    from recscale.retrieval.movielens import read_movielens
    from recscale.retrieval.recipe import build_pipeline
    from recscale.serve.retrieval_artifact import Catalog, check_retrieval_out, save_retrieval

    check_retrieval_out(Path(args.out))  # before the training, not after it
    # A model directory inside the data directory is read as data next time (e.g. one named x.inter).
    if Path(args.data).is_dir() and Path(args.data).resolve() in Path(args.out).resolve().parents:
        raise RecscaleError(
            f"--out {args.out} is inside the data directory {args.data}; name a directory outside it"
        )
    if args.k > args.candidates:
        raise RecscaleError(
            f"retrieval build: --k {args.k} is more than --candidates {args.candidates}, the items the "
            f"ranker chooses from, so queries would return only {args.candidates}; give --k <= --candidates"
        )
    data = read_movielens(Path(args.data))
    pipe, spec = build_pipeline(data, args.index, args.epochs, args.seed, args.candidates, args.k)
    save_retrieval(Path(args.out), pipe, spec, Catalog(data.user_keys, data.item_keys, data.users))
    print(
        f"retrieval model: {len(data.user_keys):,} users, {len(data.item_keys):,} items, {args.index} index, "
        f"top {args.k} of {args.candidates} candidates -> {args.out}"
    )


def cmd_retrieval_query(args: argparse.Namespace) -> None:
    from recscale.serve.retrieval_artifact import load_retriever, recommend

    model, catalog = load_retriever(Path(args.model_dir))
    print(json.dumps(recommend(model, catalog, args.users)))


def cmd_inspect(args: argparse.Namespace) -> None:
    from recscale.data.inspect import inspect_file, inspect_notes
    from recscale.io import strict_json

    # A tab is hard to type: a shell passes '\t' as backslash and t.
    delimiter = "\t" if args.delimiter in ("\\t", "tab") else args.delimiter
    options = ({"delimiter": delimiter} if delimiter is not None else {}) | (
        {"quote": False} if args.no_quote else {}
    )
    if args.columns is not None:
        options["columns"] = args.columns.split(",")

    report = inspect_file(
        args.path, args.format, options, args.max_rows, args.tables, args.max_len, args.label,
        progress=sys.stderr.isatty(), weight=args.weight,
    )  # fmt: skip
    print(strict_json(report, indent=2))
    for line in inspect_notes(report, args.label):
        print(f"note: {line}", file=sys.stderr)


def cmd_shard_plan(args: argparse.Namespace) -> None:
    from recscale.config import load_config
    from recscale.distributed.launch import host_split
    from recscale.io import check_output
    from recscale.train.loop import check_world_size
    from recscale.train.shard_plan import shard_plan

    cfg = load_config(args.config, args.overrides)
    _, local = host_split(args.nproc, args.local_world_size)
    check_world_size(cfg, args.nproc)  # a plan for a run that training would refuse is no plan
    out = Path(args.out)
    check_output(out, "--out", [("the config being planned", args.config)])
    doc = shard_plan(cfg, args.nproc, local, out)
    pred = doc["predicted"]
    cost = f"; predicted max-rank cost {pred['cost_ms']} ms" if pred else ""
    tables = len(doc["tables"])
    print(
        f"{tables} table{'s' * (tables != 1)} over {args.nproc} rank{'s' * (args.nproc != 1)}{cost}; "
        f"plan written to {args.out}"
    )


def cmd_prepare(args: argparse.Namespace) -> None:
    import time

    from recscale.config import load_config
    from recscale.io import Hold, removed_on_failure
    from recscale.train.data import prepare_run_data
    from recscale.train.runs import refuse_artifact, refuse_inside_data

    cfg = load_config(args.config, args.overrides)
    if cfg.data.prepared is not None:
        raise RecscaleError(
            f"data prepare: the config sets data.prepared={cfg.data.prepared}, which names data to read; "
            "drop it here (this command writes the directory given by --out)"
        )
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise RecscaleError(
            f"--out {out} is a file; name a directory for the prepared data (it is created if missing)"
        )
    # Its preprocess.json would be replaced, and the model no longer load.
    refuse_artifact(out, "choose another --out for the prepared data")
    refuse_inside_data(out, cfg.data, "choose an --out outside it")
    if (out / "config.yaml").is_file():  # its checkpoints index its vocabularies: never refitted under it
        raise RecscaleError(
            f"--out {out} is a run directory (it has config.yaml), whose preprocess.json preparing would "
            "replace; give the prepared data a directory of its own"
        )
    t0 = time.perf_counter()
    try:
        with _sigterm_raises(), removed_on_failure(out):  # as train: stopped, it says so (one line, 143)
            out.mkdir(parents=True, exist_ok=True)
            with Hold(out):
                _, splits, stats = prepare_run_data(
                    cfg.data, out, resume=False, main=True, progress=sys.stderr.isatty()
                )
    except (Terminated, KeyboardInterrupt) as e:
        raise _stop(
            e, f"data prepare: stopped by {{by}} before {out} was complete; run the same command again"
        ) from None
    seconds = time.perf_counter() - t0
    for name, ds in splits.items():
        skipped = stats[name].skipped if name in stats else 0
        print(f"{name:6s} {len(ds):>12,} rows" + (f"  ({skipped:,} bad rows dropped)" if skipped else ""))
    print(f"prepared in {seconds:.1f} s: {out}  (train on it with data.prepared={out})")


def cmd_sweep(args: argparse.Namespace) -> None:
    from recscale.distributed.env import shutdown
    from recscale.scaling.sweep import run_sweep

    try:
        with _sigterm_raises():  # as train: stopped, it says so (one line, 143)
            results = run_sweep(args.sweep, args.out)
    except (Terminated, KeyboardInterrupt) as e:
        shutdown()
        raise _stop(
            e,
            "sweep: stopped by {by}; run the same command again to go on (finished runs are skipped, "
            "the one stopped starts afresh)",
        ) from None
    print(f"results: {results}")


def cmd_scaling_fit(args: argparse.Namespace) -> None:
    from recscale.io import check_output
    from recscale.scaling.fit import load_results, report
    from recscale.scaling.plot import plot_scaling

    merge: dict[str, str] = {}
    for spec in args.merge:
        new, _, old = spec.partition("=")
        if not new or not old:
            raise RecscaleError(
                f"--merge {spec}: write NEW=OLD[,OLD...], e.g. --merge wukong=wukong_long,wukong_xl"
            )
        for name in old.split(","):
            if merge.setdefault(name, new) != new:  # else the last --merge would win without a word
                raise RecscaleError(
                    f"--merge: family {name!r} is merged into both {merge[name]!r} and {new!r}; merge it into one"
                )
    if args.out:
        check_output(
            Path(args.out), "--out", [("a results file being fitted", r) for r in args.results], "PNG"
        )
    families = load_results(args.results, merge, args.drop)
    text, fits = report(families, pin_floor=args.pin_floor, left_out=families.left_out)
    print(text)
    if args.out:
        print(f"plot: {plot_scaling(families, fits, args.out)}")


def cmd_dmt_partition(args: argparse.Namespace) -> None:
    from recscale.distributed.dmt.partitioner import feature_stats, partition_report, summary
    from recscale.io import atomic_write_text
    from recscale.train.runs import check_run_output, load_training_sample

    out = Path(args.out) if args.out else Path(args.run_dir) / f"dmt_towers_{args.towers}.json"
    check_run_output(out, "--out", Path(args.run_dir), None)  # not over the run's own files, before the work
    embedding, batch, pre = load_training_sample(
        Path(args.run_dir), args.rows, "to partition into DMT towers"
    )
    stats = feature_stats(embedding, batch, pre.num_embeddings)
    report = partition_report(stats, args.towers, args.tolerance)
    atomic_write_text(out, json.dumps(report, indent=2))
    print(summary(report))
    print(f"assignment: {out}  (use it as dmt.assignment={out})")


def cmd_precision_probe(args: argparse.Namespace) -> None:
    import shlex

    from recscale.io import atomic_write_text, strict_json
    from recscale.train.probe import DEFAULT_FORMATS, probe, table
    from recscale.train.runs import check_run_output

    formats = args.formats or DEFAULT_FORMATS
    out = Path(args.out) if args.out else Path(args.run_dir) / "precision_plan.json"
    check_run_output(out, "--out", Path(args.run_dir), args.data)  # before the probe's minutes of work
    plan = probe(Path(args.run_dir), args.data, args.rows, formats, args.target, args.tolerance)
    atomic_write_text(out, strict_json(plan, indent=2))
    print(table(plan))
    layers = json.dumps(plan["model.quant"]["layers"], separators=(",", ":"))
    print(f"plan: {out}  (train with it: {shlex.quote(f'model.quant.layers={layers}')})")


def _scoring_options(p: argparse.ArgumentParser) -> None:
    """The options eval and predict share: the run, the file and how to read it, the ranks."""
    p.add_argument("run_dir")
    p.add_argument(
        "overrides",
        nargs="*",
        help="reader options as train takes them, e.g. \"data.options={delimiter: ','}\" (default: the run's data.options)",
    )
    p.add_argument(
        "--data",
        help="file in the same format as the run's training data (a synthetic run: its own test split)",
    )
    p.add_argument(
        "--format",
        help="override the data format (default: the run's; another format reads with its default data.options)",
    )
    p.add_argument(
        "--on-bad-row",
        choices=["error", "skip"],
        help="stop at a bad row, or drop and count them (skipped_rows); default: the run's data.on_bad_row",
    )
    p.add_argument(
        "--nproc",
        type=_int_in(1),
        help="score with N local processes (ranks), each holding its share of the tables, for a run whose "
        "tables do not fit one process (DMT runs: one process)",
    )


def _int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer from ``lo`` to ``hi`` (no upper bound when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(
                f"must be {f'>= {lo}' if hi is None else f'{lo} to {hi}'}, got {value}"
            )
        return value

    return parse


def _float_from(lo: float) -> Callable[[str], float]:
    """An argparse type: a finite number >= ``lo``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < lo:
            raise argparse.ArgumentTypeError(f"must be a finite number >= {lo}, got {text}")
        return value

    return parse


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line errors (its default prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="recscale", description="Train and evaluate large-scale recommendation models.")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model from a YAML config",
                       description="Train a model. Overrides are dotted keys, e.g. train.max_steps=100 model.num_layers=4.")  # fmt: skip
    t.add_argument("config", nargs="?", help="YAML config (see configs/)")
    t.add_argument("overrides", nargs="*", help="key=value overrides of config keys")
    t.add_argument("--out", help="run directory (default runs/<config name>)")
    t.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    t.add_argument("--nproc", type=_int_in(1), help="train with N local processes (ranks), as torchrun would")
    t.add_argument(
        "--local-world-size",
        type=_int_in(1),
        help="with --nproc: ranks per simulated host, e.g. --nproc 4 --local-world-size 2 is 2 hosts x 2",
    )
    t.add_argument(
        "--max-restarts",
        type=_int_in(0),
        default=0,
        help="with --nproc: restart the ranks this often after a failure, resuming from the last checkpoint "
        "(default 0)",
    )
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="score a trained run on a data file; prints one JSON line")
    _scoring_options(e)
    e.add_argument(
        "--split",
        choices=["train", "valid", "report", "test"],
        help="score the run's own rows of this split instead of a file, as it materialised them (the valid rows "
        "of data.valid_fraction; valid and report: the halves of data.report_fraction)",
    )
    e.add_argument(
        "--group-by",
        metavar="FIELD",
        help="also the group AUC over this single-id feature's ids (e.g. the user): gauc, gauc_groups, gauc_rows",
    )
    e.add_argument(
        "--predictions",
        metavar="FILE",
        help="also write each row's predicted probability: columns label (weight: a weighted run's file), score "
        "and the row's line (text) or "
        "row (Parquet) in the file, one row per row read, in file order (bad rows --on-bad-row skip drops left "
        "out); Parquet if FILE ends in .parquet, else CSV (gzip-compressed for .gz; also .bz2, .zst, .lz4)",
    )
    e.set_defaults(fn=cmd_eval)

    pr = sub.add_parser(
        "predict",
        help="score new rows with a trained run: each row's probability, written to a file",
        description="Each row's predicted click probability (score) and its position in the file (line of a "
        "text file, header = line 1; row of a Parquet file), in file order. CSV, Parquet and Criteo files need no "
        "label column (Criteo: the test files' 39 fields); libsvm and MovieLens are read as training read them.",
    )
    _scoring_options(pr)
    pr.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="where to write: Parquet if FILE ends in .parquet, else CSV (gzip-compressed for .gz; also .bz2, .zst, .lz4)",
    )
    pr.set_defaults(fn=cmd_predict)

    x = sub.add_parser("export", help="write a trained run as a self-contained model directory for serving",
                       description="Export the run's best (else latest) model: config, vocabularies and weights "
                                   "(safetensors), with a manifest of sha256 hashes; tables optionally quantized.")  # fmt: skip
    x.add_argument("run_dir")
    x.add_argument(
        "--out", required=True, help="model directory to write (created; an older export is replaced)"
    )
    x.add_argument("--tables", choices=["fp32", "fp16", "int8", "int4"], default="fp32",
                   help="table storage: int8/int4 are fbgemm row-wise quantized (default fp32)")  # fmt: skip
    x.add_argument("--dense", choices=["fp32", "bf16", "int8"], default="fp32",
                   help="dense weights: bf16 stores them in bfloat16 and scores under bf16 autocast; int8 "
                        "stores each weight matrix row-wise int8 (fp32 scale per row) and scores in fp32 (default fp32)")  # fmt: skip
    x.set_defaults(fn=cmd_export)

    sv = sub.add_parser("serve", help="serve an exported model over HTTP: POST /score, GET /healthz, /readyz",
                        description='POST /score with {"rows": [{feature: value, ...}, ...]} answers '
                                    '{"scores": [p, ...]} in row order; a retrieval model (recscale retrieval '
                                    'build) answers POST /retrieve {"users": [...]} instead (docs/SERVING.md).')  # fmt: skip
    sv.add_argument("model_dir")
    sv.add_argument(
        "--port", type=_int_in(0, 65535), default=8000, help="port to listen on (default 8000; 0: a free one)"
    )
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument(
        "--max-batch", type=_int_in(1), default=1024, help="rows scored together at most (default 1024)"
    )
    sv.add_argument("--max-wait-ms", type=_float_from(0), default=0.0,
                    help="how long a request waits for others to batch with (default 0: the requests "
                         "queued while the last batch was scored form the next one)")  # fmt: skip
    sv.add_argument("--no-batching", action="store_true", help="score every request alone")
    sv.add_argument(
        "--threads", type=_int_in(1), default=1, help="scoring threads per worker process (default 1)"
    )
    sv.add_argument("--workers", type=_int_in(1), default=1,
                    help="server processes on the one port, each loading the model (default 1)")  # fmt: skip
    sv.add_argument("--torch-threads", type=_int_in(1),
                    help="torch intra-op threads per worker (default: torch's default divided by --workers)")  # fmt: skip
    sv.add_argument("--max-rows", type=_int_in(1), default=4096,
                    help="rows (retrieval: users) per request at most (default 4096)")  # fmt: skip
    sv.add_argument(
        "--max-body-kb", type=_int_in(1), default=8192, help="request body size limit (default 8192 KiB)"
    )
    sv.set_defaults(fn=cmd_serve)

    rt = sub.add_parser(
        "retrieval", help="model-based retrieval: two-tower + item index + ranker (docs/SERVING.md)"
    )
    rtsub = rt.add_subparsers(dest="retrieval_command", required=True)
    rb = rtsub.add_parser("build", help="train a retrieve -> rank model on MovieLens-format data and save it",
                          description="Two-tower on the train split's positives, its item vectors as the index, a "
                                      "Bloom filter of the train positives, a ranker on the train ratings.")  # fmt: skip
    rb.add_argument("data", help="MovieLens-100k RecBole atomic files (.inter, .user, .item)")
    rb.add_argument("--out", required=True, help="model directory to write")
    rb.add_argument("--index", choices=["exact", "int8", "ivf", "ivf-int8"], default="int8",
                    help="item index: fp32 rows, int8 rows, or IVF lists of either (default int8)")  # fmt: skip
    rb.add_argument(
        "--epochs", type=_int_in(1), default=5, help="epochs of the towers and of the ranker (default 5)"
    )
    rb.add_argument("--seed", type=_int_in(0), default=0, help="seed of the whole build (default 0)")
    rb.add_argument("--candidates", type=_int_in(1), default=100,
                    help="items the index retrieves for the ranker (default 100)")  # fmt: skip
    rb.add_argument("--k", type=_int_in(1), default=10, help="items returned per user (default 10)")
    rb.set_defaults(fn=cmd_retrieval_build)
    rq = rtsub.add_parser(
        "query", help="top items of users (raw ids) from a built model; prints one JSON line"
    )
    rq.add_argument("model_dir")
    rq.add_argument("users", nargs="+", help="raw user ids, as in the data")
    rq.set_defaults(fn=cmd_retrieval_query)

    d = sub.add_parser("data", help="data utilities")
    dsub = d.add_subparsers(dest="data_command", required=True)
    i = dsub.add_parser(
        "inspect",
        help="schema, row count and per-field cardinality of a data file, or of a split's parts (a folder or a glob pattern)",
    )
    i.add_argument("path")
    i.add_argument("--format", help="csv, libsvm, criteo, movielens or parquet (default: guessed)")
    i.add_argument(
        "--delimiter",
        help="csv: the field separator, as data.options.delimiter (default ,; \\t or tab: a tab; given, the format is csv)",
    )
    i.add_argument("--no-quote", action="store_true",
                   help="csv: '\"' is no quote but a character of its cell, as data.options.quote: false")  # fmt: skip
    i.add_argument("--columns",
                   help="csv without a header line: its columns, comma-separated, as data.options.columns (given, the format is csv)")  # fmt: skip
    i.add_argument("--label", default="label",
                   help="csv, parquet: the label column, 0/1 (default: label); the schema names it as data.schema.label")  # fmt: skip
    i.add_argument("--weight",
                   help="csv, parquet: a column of per-row importance weights: the schema names it as data.schema.weight, not as a dense feature")  # fmt: skip
    i.add_argument("--max-rows", type=_int_in(1),
                   help="read only the file's first N rows, good or bad (movielens: its first N ratings by time)")  # fmt: skip
    i.add_argument("--tables", action="store_true",
                   help="also each id column's pooling factor and 17-bin access histogram (learned sharding)")  # fmt: skip
    i.add_argument("--max-len", type=_int_in(1),
                   help="also the rows of each multi-id column a sequence feature of this max_len would cut")  # fmt: skip
    i.set_defaults(fn=cmd_inspect)
    dprep = dsub.add_parser("prepare", help="fit the vocabularies and materialise every split once, for many runs",
                         description="Prepare a config's data into DIR (vocabularies, memory-mapped columns); "
                                     "runs then train on it with data.prepared=DIR. Overrides as for train.")  # fmt: skip
    dprep.add_argument("config", help="YAML config (only its data section is used)")
    dprep.add_argument("overrides", nargs="*", help="key=value overrides of config keys")
    dprep.add_argument("--out", required=True, help="directory for the prepared data (created if missing)")
    dprep.set_defaults(fn=cmd_prepare)

    sh = sub.add_parser("shard", help="embedding sharding tools (docs/SHARDING.md)")
    shsub = sh.add_subparsers(dest="shard_command", required=True)
    shp = shsub.add_parser("plan", help="write the sharding plan a run of CONFIG would train with, as JSON",
                           description="Plan CONFIG's tables as training would (distributed.sharding), over --nproc "
                                       "ranks; for sharding=learned with predicted per-rank cost and memory.")  # fmt: skip
    shp.add_argument("config", help="YAML config")
    shp.add_argument("overrides", nargs="*", help="key=value overrides of config keys")
    shp.add_argument("--out", required=True, help="plan JSON to write")
    shp.add_argument("--nproc", type=_int_in(1), default=4, help="ranks (default 4)")
    shp.add_argument("--local-world-size", type=_int_in(1), help="ranks per host (default: all on one host)")
    shp.set_defaults(fn=cmd_shard_plan)

    s = sub.add_parser("sweep", help="train a grid of model sizes, one pass each; results as CSV",
                       description="Train every size of every family in SWEEP (see configs/sweeps/); "
                                   "finished runs are skipped when the sweep is run again.")  # fmt: skip
    s.add_argument("sweep", help="sweep YAML")
    s.add_argument("--out", help="sweep directory (default: the file's out)")
    s.set_defaults(fn=cmd_sweep)

    sc = sub.add_parser("scaling", help="scaling-law analysis of sweep results")
    scsub = sc.add_subparsers(dest="scaling_command", required=True)
    f = scsub.add_parser("fit", help="fit loss = L_inf + a*C^-b per family; optional PNG plot")
    f.add_argument("results", nargs="+", help="sweeps' results.csv files (a run in several counts once)")
    f.add_argument(
        "--merge",
        action="append",
        default=[],
        metavar="NEW=OLD[,OLD...]",
        help="fit these families as one (sweeps of one study, e.g. one that added a longer length)",
    )
    f.add_argument("--drop", action="append", default=[], metavar="PATTERN", help="leave out these families")
    f.add_argument("--out", help="write the plot to this PNG")
    f.add_argument(
        "--pin-floor",
        action="store_true",
        help="fix L_inf at the synthetic teacher's Bayes floor (a power law in the reducible loss)",
    )
    f.set_defaults(fn=cmd_scaling_fit)

    dm = sub.add_parser("dmt", help="Disaggregated Multi-Tower tools (docs/DMT.md)")
    dmsub = dm.add_subparsers(dest="dmt_command", required=True)
    dp = dmsub.add_parser(
        "partition",
        help="group features into balanced towers from a trained flat run "
        "(or a DMT run with identity tower modules)",
    )
    dp.add_argument("run_dir")
    dp.add_argument(
        "--towers", type=_int_in(1), required=True, help="number of towers (= hosts of the DMT run)"
    )
    dp.add_argument("--tolerance", type=_float_from(0), default=0.25,
                    help="allowed load above the mean per tower, as a fraction of it (default 0.25)")  # fmt: skip
    dp.add_argument("--rows", type=_int_in(1), default=4096,
                    help="training rows to measure the affinity on (default 4096)")  # fmt: skip
    dp.add_argument("--out", help="assignment JSON (default RUN_DIR/dmt_towers_K.json)")
    dp.set_defaults(fn=cmd_dmt_partition)

    pr = sub.add_parser("precision", help="low-precision (MX, FP8) tools")
    prsub = pr.add_subparsers(dest="precision_command", required=True)
    pp = prsub.add_parser("probe", help="per-layer error of MX/FP8 formats in a trained run, and a plan of layers to lower",
                          description="Lower one linear layer at a time to each format; measure its output error and the "
                                      "model's AUC/LogLoss; plan the layers that fit the target within the tolerance.")  # fmt: skip
    pp.add_argument("run_dir")
    pp.add_argument("--data", help="calibrate on this file (default: the run's valid split)")
    pp.add_argument(
        "--rows",
        type=_int_in(1),
        default=16384,
        help="calibration rows, a seeded random subset (default 16384)",
    )
    pp.add_argument(
        "--formats", nargs="+", metavar="FMT", help="formats to probe (default: the six MX formats)"
    )
    pp.add_argument("--target", default="mxfp8_e4m3", help="the plan's format (default mxfp8_e4m3)")
    pp.add_argument(
        "--tolerance", type=_float_from(0), default=5e-4, help="allowed AUC drop of the plan (default 0.0005)"
    )
    pp.add_argument("--out", help="plan JSON (default RUN_DIR/precision_plan.json)")
    pp.set_defaults(fn=cmd_precision_probe)
    return p


_OS_HINTS = {
    errno.ENOSPC: "the disk is full; free space or choose another --out",
    errno.EDQUOT: "the disk quota is exhausted; free space or choose another --out",
    errno.EROFS: "the file system is read-only; choose a writable --out",
    errno.EACCES: "permission denied; fix its permissions (an output: or choose a path you may write)",
    errno.EPERM: "operation not permitted; fix its permissions (an output: or choose a path you may write)",
    errno.ENOTDIR: "a part of the path is a file, not a directory; fix the path",
    errno.EISDIR: "it is a directory where a file was expected; fix the path",
    errno.EEXIST: "it already exists; remove it or choose another path",
    errno.EFBIG: "the file grew past the size this process may write (ulimit -f); raise the limit",
    errno.ENAMETOOLONG: "the path is too long; choose a shorter one",
    errno.EMFILE: "this process may open no more files (ulimit -n; a split holds files per sparse field); "
    "raise the limit",
    errno.EBUSY: "another recscale command is writing there; wait for it to finish or choose another --out",
}


def _os_error_line(e: OSError) -> str:
    where = f"{e.filename}: " if e.filename else ""
    hint = _OS_HINTS.get(e.errno or 0, "check the path and the disk")
    return f"{where}{e.strerror or e} ({hint})"


def _unencodable(e: UnicodeError) -> tuple[str | bytes, int]:
    """A character stdout's encoding lacks: a file name's byte no encoding decoded (a surrogate) as that byte,
    anything else escaped (``\\xb7``), as stderr writes it."""
    try:
        return codecs.lookup_error("surrogateescape")(e)
    except UnicodeError:
        return codecs.lookup_error("backslashreplace")(e)


codecs.register_error("recscale.stdout", _unencodable)


def _stdout_never_fails_to_encode() -> None:
    """In a locale whose encoding lacks a character printed (LC_ALL=C with PYTHONUTF8=0, PYTHONIOENCODING=ascii),
    the report's '·' raised UnicodeEncodeError once the run had trained: 'internal error', exit code 1."""
    if isinstance(sys.stdout, io.TextIOWrapper) and sys.stdout.errors in ("strict", "surrogateescape"):
        sys.stdout.reconfigure(errors="recscale.stdout")


def _closed_streams_to_devnull() -> None:
    """stdout or stderr closed when the command started (``2>&-``, a daemon's setup): Python leaves ``sys.stderr``
    None, on which training's progress check called isatty() ('internal error AttributeError' before the first
    step), and the descriptor free for the next file opened, into which C++ libraries' messages would go. Both
    write to /dev/null instead, as the user asked of a closed stream."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        if getattr(sys, name) is not None:
            continue
        try:
            os.fstat(fd)  # a file this process opened since has it: left alone
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)  # the lowest free descriptor: ``fd`` itself, or below
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        setattr(sys, name, open(os.devnull, "w"))  # the process's stream, open while it lives


def _unblock_stop_signals() -> None:
    """Let SIGINT, SIGTERM and SIGHUP through where the parent left them blocked: the mask survives exec and
    Python never clears it, so such a `recscale train` went on through Ctrl-C and SIGTERM until it ended.
    Signals the parent ignored (nohup, `trap '' INT`) stay ignored: that is their disposition, not the mask."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


def main(argv: list[str] | None = None) -> int:
    _unblock_stop_signals()
    _closed_streams_to_devnull()
    _stdout_never_fails_to_encode()
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv  # accepted anywhere on the line, not only before the command
    argv = [a for a in argv if a != "--debug"]
    # Overrides may follow options (`train CFG --out D k=v`), which argparse leaves unparsed.
    try:
        args, extra = parser.parse_known_args(argv)
        # Named by the command that got them (`recscale train: ...`, `see recscale train --help`), where its
        # options are listed, not by `recscale`.
        words = [parser.prog, args.command, getattr(args, f"{args.command}_command", None)]
        usage = _Parser(prog=" ".join(w for w in words if w))
        if extra:
            if not hasattr(args, "overrides") or any(x.startswith("-") for x in extra):
                usage.error(f"unrecognized arguments: {' '.join(extra)}")
            args.overrides += extra
        # An empty path (`--predictions ""`, a shell variable unset) was taken as no option at all.
        for name in ("out", "data", "predictions"):
            if getattr(args, name, None) == "":
                usage.error(f"--{name} is an empty path; name a file")
    except SystemExit as e:  # --help, or a usage error already printed as one line
        return int(e.code or 0)
    args.debug = debug  # the ranks of train --nproc show their tracebacks too
    quiet_upstream()
    try:
        from recscale.distributed.env import launch_env
        from recscale.io import raise_open_file_limit

        launch_env()  # a RANK left in the shell would make every command act as a rank of a job
        raise_open_file_limit()  # a split of hundreds of sparse fields holds a file open per field
        args.fn(args)
    except KeyboardInterrupt as e:  # train, data prepare and sweep say where they stopped and how to go on
        print(e.args[0] if e.args and isinstance(e.args[0], str) else "interrupted", file=sys.stderr)
        return 130
    except Terminated as e:  # a command stopped by SIGTERM says where (cmd_train, cmd_prepare, cmd_sweep)
        print(e, file=sys.stderr)
        return 128 + signal.SIGTERM
    except BrokenPipeError:  # the reader went away (`recscale data inspect F | head`): nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
    except Exception as e:
        if debug:
            raise
        from recscale.distributed.env import record_error

        code, line = _error_line(e)
        # A rank under --nproc leaves its line to the launcher, which prints the job's one line.
        if not record_error(line, consequence=code == LOST_PEER_EXIT):
            print(f"error: {line}", file=sys.stderr)
        return code
    return 0


def _locale_encoding() -> str | None:
    """The encoding file names and the terminal are written in, where it is not UTF-8 (else None)."""
    name = codecs.lookup(sys.getfilesystemencoding()).name
    return None if name == "utf-8" else name


def _undecoded(text: str) -> bool:
    """Whether ``text`` is bytes of a file name no encoding decoded (Python's surrogate escapes)."""
    return all("\udc80" <= c <= "\udcff" for c in text)


def _error_line(e: Exception) -> tuple[int, str]:
    """The exit code and one line for an exception that ends a command (``--debug`` shows the traceback)."""
    from recscale.distributed.env import lost_peer

    if isinstance(e, RecscaleError):
        return 2, " ".join(str(e).split("\n"))
    if isinstance(e, OSError):
        return 2, _os_error_line(e)
    if isinstance(e, MemoryError):
        return 2, "out of memory; lower train.batch_size or the model size, or use more ranks (--nproc)"
    if isinstance(e, RuntimeError) and (line := lost_peer(e)) is not None:
        return LOST_PEER_EXIT, line
    if isinstance(e, UnicodeEncodeError) and _undecoded(e.object[e.start : e.end]):
        # A file name's bytes that are not UTF-8, which TensorBoard cannot write (an --out of Latin-1 bytes)
        name = os.fsencode(e.object[:200])
        return 2, f"the name {name!r} is not UTF-8, which a library recscale uses cannot write; rename it"
    if isinstance(e, UnicodeEncodeError) and codecs.lookup(e.encoding).name == _locale_encoding():
        # A name (a config's base:, a data path) the locale cannot write, e.g. LC_ALL=C with PYTHONUTF8=0
        return 2, (
            f"the name {e.object[:200]!r} holds {e.object[e.start : e.end]!r}, which this locale's encoding "
            f"({e.encoding}) cannot express; run under a UTF-8 locale (e.g. LC_ALL=C.UTF-8) or set PYTHONUTF8=1"
        )
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return (
        1,
        f"internal error {type(e).__name__}: {first} (rerun with --debug for the traceback and report it)",
    )


def run() -> NoReturn:
    """``python -m recscale`` (or ``-m recscale.cli``, as the launcher starts ranks): main(), then exit."""
    code = main()
    if "RANK" in os.environ:  # a rank of --nproc or torchrun: done, it ends without exit-time destructors
        from recscale.distributed.env import exit_rank

        exit_rank(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
