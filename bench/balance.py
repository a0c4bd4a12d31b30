"""FreeScale-style balancing under Zipf-skewed history lengths: contiguous slices against ``balance``.

    python bench/balance.py --world 2 4 --steps 8 --repeats 3

For each world size, one launch of W gloo ranks (1 thread each) on the synthetic teacher with one history
feature whose lengths are Zipf-skewed (``history_alpha``), a causal-transformer sequence encoder, and the
trainer's own ``train_step``. Each repeat trains ``--steps`` steps contiguous (``balance: none``), then the
same steps balanced (``--balance``, default tokens2), each from a freshly built model (same seed), in
alternating order across repeats. Per step it records:

- step time: from a barrier before ``train_step`` to a barrier after it (the straggler sets it);
- per-rank compute: forward + backward of the rank's part on a local, unsharded replica of the model,
  all ranks timed side by side between barriers (no collectives, so no waiting is counted), the median of
  ``--compute-repeats`` timings (one timing alone carries the machine's noise into max / mean);
- the predicted cost of each rank's part (padding included where the cost model knows the encoder's
  buckets: ``flops``) and the step's loss (balanced must equal contiguous).

Prints one JSON line per world size and mode (medians over repeats x steps), and the loss gap.

``--serial`` needs no core per rank (the 2-core development machine): one process, one thread, times each
rank's part of the same global batches in turn (the median of ``--compute-repeats`` timings each), for
contiguous slices and for ``--balance``. It gives the per-rank compute imbalance and the slowest part's
time (what the step waits for), not a step time: no collectives run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"data.synthetic.rows={{train: {args.batch * (args.steps + 1)}, valid: 256, test: 256}}",
        "data.synthetic.num_sparse=4", "data.synthetic.num_multi=0", "data.synthetic.num_history=1",
        f"data.synthetic.history_max_len={args.max_len}", f"data.synthetic.history_alpha={args.alpha}",
        "data.num_workers=0", f"model.embedding.dim={args.dim}", "model.num_layers=1",
        f"model.embedding.sequence={{encoder: causal, layers: {args.encoder_layers}, heads: 2, buckets: {args.buckets}}}",
        f"train.batch_size={args.batch}", "train.progress=false", "train.early_stopping=null",
        "distributed.sharding=table_wise",
    ]  # fmt: skip


def time_compute(model, batch, repeats: int) -> float:
    """Median seconds of forward + backward of ``model`` on ``batch``, after one untimed pass."""
    from torch import nn

    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        logits = model(batch.dense, batch.sparse)
        nn.functional.binary_cross_entropy_with_logits(logits, batch.labels).backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def replica_and_costs(trainer, cfg, balance: str):
    """An unsharded replica of the trainer's model (the config's seed), the history features' names, and
    the ``balance`` mode's cost model."""
    import torch

    from recscale.models.registry import build_model
    from recscale.train.build import feature_set
    from recscale.train.loop import cost_model

    torch.manual_seed(cfg.seed)
    replica = build_model(cfg.model.name, feature_set(trainer.pre), cfg.model.embedding, cfg.model.params)
    names = [f.name for f in trainer.pre.schema.sparse if f.sequence]
    return replica, names, cost_model(balance, replica, replica.flops_per_example(), names)


def serial(args: argparse.Namespace) -> None:
    """Each rank's part timed in turn in this process (see the module doc); one JSON line per world."""
    import logging

    import torch

    from recscale.config import load_config
    from recscale.data.dataset import epoch_batches, iterate
    from recscale.distributed.balance import balanced_parts, imbalance, part_cost
    from recscale.train.loop import Trainer

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="recscale-balance-") as tmp:
        cfg = load_config(REPO / "configs/demo.yaml", [*overrides(args), "distributed.balance=none"])
        trainer = Trainer(cfg, Path(tmp) / "run")
        replica, names, costs = replica_and_costs(trainer, cfg, args.balance)
        ds = trainer.train_ds

        def batches(**kw) -> list:
            return epoch_batches(len(ds), args.batch, seed=cfg.seed, epoch=0, drop_last=True, **kw)

        for world in args.world:
            out: dict[str, dict] = {}
            for mode in ("none", args.balance):
                if mode == "none":  # rank r's contiguous slice, as the trainer takes it
                    ranks = [batches(rank=r, world_size=world) for r in range(world)]
                    steps = [[part[i] for part in ranks] for i in range(args.steps)]
                else:
                    steps = [[b[q] for q in balanced_parts(ds.lengths(b, names), costs, world)]
                             for b in batches()[: args.steps]]  # fmt: skip
                compute, cost = [], []
                for parts in steps:
                    compute.append(
                        [time_compute(replica, b, args.compute_repeats) for b in iterate(ds, parts)]
                    )
                    cost.append([part_cost(ds.lengths(q, names), costs) for q in parts])
                slowest = np.array(compute).max(axis=1)
                out[mode] = {
                    "world": world, "mode": mode, "serial": True,
                    "per_rank_compute_s_median": np.median(compute, axis=0).round(4).tolist(),
                    "compute_max_over_mean_median": statistics.median(imbalance(np.array(c)) for c in compute),
                    "cost_max_over_mean_median": statistics.median(imbalance(np.array(c)) for c in cost),
                    "slowest_part_s_mean": float(slowest.mean()),
                }  # fmt: skip
            for r in out.values():
                r["slowest_part_speedup_vs_none"] = round(
                    out["none"]["slowest_part_s_mean"] / r["slowest_part_s_mean"], 3
                )
                print(json.dumps(r), flush=True)
        trainer.log.close()


def worker(spec_path: str) -> None:
    import logging

    import torch
    import torch.distributed as dist

    from recscale.config import load_config
    from recscale.distributed.balance import imbalance, part_cost
    from recscale.distributed.env import shutdown
    from recscale.train.loop import Trainer

    logging.disable(logging.WARNING)
    spec = json.loads(Path(spec_path).read_text())
    args = argparse.Namespace(**spec["args"])
    results: dict[str, dict[str, list]] = {}
    for rep in range(args.repeats):
        modes = ["none", args.balance] if rep % 2 == 0 else [args.balance, "none"]
        for mode in modes:
            cfg = load_config(REPO / "configs/demo.yaml", [*overrides(args), f"distributed.balance={mode}"])
            trainer = Trainer(cfg, Path(spec["root"]) / f"{mode}_{rep}")
            # The balanced mode's predicted costs, recorded for contiguous slices too.
            replica, names, costs = replica_and_costs(trainer, cfg, args.balance)
            rec = results.setdefault(mode, {"step_s": [], "compute_s": [], "cost": [], "loss": []})
            for i, (batch, global_size) in enumerate(trainer._epoch()):
                if i == args.steps:
                    break
                dist.barrier()
                t0 = time.perf_counter()
                loss = trainer.train_step(batch, global_size)
                dist.barrier()
                step = time.perf_counter() - t0
                compute = time_compute(replica, batch, args.compute_repeats)
                dist.barrier()
                lengths = batch.sparse.to_dict()[names[0]].lengths().numpy()[:, None]
                cost = part_cost(lengths, costs)
                local = torch.tensor([compute, cost, float(loss)], dtype=torch.float64)
                gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
                dist.all_gather(gathered, local)
                g = torch.stack(gathered)
                loss_mean = float(g[:, 2].mean())  # what the trainer logs: the ranks' mean
                if rep == 0:
                    rec["loss"].append(loss_mean)
                rec["step_s"].append(step)
                rec["compute_s"].append(g[:, 0].tolist())
                rec["cost"].append(g[:, 1].tolist())
            trainer.log.close()
    if dist.get_rank() == 0:
        out = {}
        for mode, rec in results.items():
            compute, cost = np.array(rec["compute_s"]), np.array(rec["cost"])
            out[mode] = {
                "step_s_median": statistics.median(rec["step_s"]),
                "per_rank_compute_s_median": np.median(compute, axis=0).round(4).tolist(),
                "compute_max_over_mean_median": statistics.median(imbalance(c) for c in compute),
                "cost_max_over_mean_median": statistics.median(imbalance(c) for c in cost),
                "losses": rec["loss"],
            }
        Path(spec["out"]).write_text(json.dumps(out))
    shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=512, help="global batch")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent of the history lengths")
    p.add_argument("--buckets", type=lambda v: v if v == "pow2" else int(v), default=4,
                   help="length buckets per rank batch: N equal counts, or pow2")  # fmt: skip
    p.add_argument("--dim", type=int, default=16, help="embedding dim (the encoder's width)")
    p.add_argument("--encoder-layers", type=int, default=1, help="causal-transformer blocks over the history")
    p.add_argument("--balance", choices=["tokens", "tokens2", "flops"], default="tokens2")
    p.add_argument("--compute-repeats", type=int, default=3, help="timings per rank's part (median)")
    p.add_argument("--serial", action="store_true", help="time the ranks' parts in turn in one process")
    args = p.parse_args()
    if args.serial:
        serial(args)
        return
    from recscale.distributed.launch import launch

    for world in args.world:
        with tempfile.TemporaryDirectory(prefix="recscale-balance-") as tmp:
            spec = {"args": vars(args), "root": tmp, "out": f"{tmp}/out.json"}
            (Path(tmp) / "spec.json").write_text(json.dumps(spec))
            launch([__file__, "worker", f"{tmp}/spec.json"], world, world, 0)
            out = json.loads(Path(spec["out"]).read_text())
        ref = out["none"]
        for mode, r in out.items():
            gap = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"], strict=True))
            speedup = ref["step_s_median"] / r["step_s_median"]
            row = {k: v for k, v in r.items() if k != "losses"}
            print(json.dumps({"world": world, "mode": mode, **row, "speedup_vs_none": round(speedup, 3),
                              "max_loss_gap_vs_none": gap}), flush=True)  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2])
    else:
        main()
