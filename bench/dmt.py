"""DMT benchmark: bytes per step by locality and modelled step time on a slow inter-host link.

    python bench/dmt.py                       # 2 hosts x 2 ranks, then 4 hosts x 1
    python bench/dmt.py --topologies 2x2 --steps 5

One launch per topology trains every variant in turn with the real trainer (Wukong on synthetic
data, single-id features): flat sharding (table_wise, row_wise, table_row_wise) and DMT with a
Wukong-layer tower module at compression 1x (identity), 2x and 4x. Per variant:

- bytes: per training step, summed over ranks, from ``comms.CommMeter``; the inter-host bytes of
  the embeddings are checked against ``dmt.volumes``' closed forms: all-to-alls for flat table_wise
  and DMT, the pooled embeddings' reduce-scatter and all-gather for row_wise.
- time: the measured step on this machine (every "host" is a process group on one machine, so its
  inter-host links are loopback), plus a link-cost model: each host sends its share of the inter-host
  bytes through one NIC of bandwidth BW, not overlapped with compute:
  t(BW) = t_measured + (inter bytes per step / hosts) / BW.

Writes runs/bench/dmt.json and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import warnings
from pathlib import Path

from rank_workers import OUT, REPO, add_worker_args, rank_batches, run_workers  # bench/ is on sys.path

BANDWIDTHS = {"100 Mbit/s": 100e6 / 8, "1 Gbit/s": 1e9 / 8, "10 Gbit/s": 10e9 / 8}
FLAT = ("table_wise", "row_wise", "table_row_wise")
DMT = {"dmt_1x": ("identity", 1), "dmt_2x": ("wukong", 2), "dmt_4x": ("wukong", 4)}


def _overrides(args: argparse.Namespace, variant: str) -> list[str]:
    base = [
        f"data.synthetic.rows.train={args.batch * (args.steps + 2)}", "data.synthetic.rows.valid=256",
        "data.synthetic.rows.test=256", f"data.synthetic.num_sparse={args.features}", "data.synthetic.num_multi=0",
        f"data.synthetic.vocab_sizes={args.vocab}", "data.num_workers=0", "train.progress=false",
        f"train.batch_size={args.batch}", f"model.embedding.dim={args.dim}", "model.num_layers=1",
        "model.fmb_mlp=[64]", "model.final_mlp=[64]", "distributed.count_bytes=true",
    ]  # fmt: skip
    if variant in FLAT:
        return [*base, f"distributed.sharding={variant}"]
    kind, ratio = DMT[variant]
    return [*base, f"dmt.tower_module={{type: {kind}, compression: {ratio}}}"]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from recscale.config import load_config
    from recscale.distributed import comms
    from recscale.distributed.dmt.volumes import (
        dmt_embedding_inter,
        row_wise_pooled_inter,
        table_wise_embedding_inter,
    )
    from recscale.distributed.env import shutdown
    from recscale.train.loop import Trainer

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")  # TorchRec and DDP warn on every build
    results = []
    for variant in (*FLAT, *DMT):
        cfg = load_config(REPO / "configs" / "demo.yaml", _overrides(args, variant))
        trainer = Trainer(cfg, Path(args.run_dir) / variant)
        env, model, meter, step = trainer.env, trainer.built.model, trainer.comm, trainer.train_step
        batches = rank_batches(trainer, args.batch, args.steps + 2)

        for b in batches[:2]:  # warm-up
            step(b)
        meter.reset()
        dist.barrier()
        t0 = time.perf_counter()
        for b in batches[2:]:  # the step training runs; it records bytes (distributed.count_bytes)
            step(b)
        dist.barrier()
        wall = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        total = meter.totals()
        dist.all_reduce(total)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        topo, local_batch = env.topology, args.batch // env.world_size
        bytes_ = comms.summarize(total, args.steps)
        inter = {k: v["inter"] for k, v in bytes_["comm"].items()}
        if variant in ("table_wise", "table_row_wise"):
            # table_wise: table i on rank i mod W; table_row_wise: on the ranks of host i mod H
            row_wise = variant == "table_row_wise"
            owners = {
                i: topo.ranks_of_host(i % topo.num_hosts)[0] if row_wise else i % env.world_size
                for i in range(args.features)
            }
            row_shards = topo.local_world_size if row_wise else 1
            checked = (
                "all_to_all",
                inter["all_to_all"],
                table_wise_embedding_inter(topo, local_batch, owners, args.dim, row_shards=row_shards),
            )
        elif variant == "row_wise":
            pooled = inter.get("reduce_scatter", 0) + inter.get("all_gather", 0)
            checked = (
                "reduce_scatter + all_gather",
                pooled,
                row_wise_pooled_inter(topo, local_batch, args.features, args.dim),
            )
        elif variant in DMT:
            features = [len(t) for t in model.tower_features]
            checked = (
                "all_to_all",
                inter["all_to_all"],
                dmt_embedding_inter(topo, local_batch, features, model.outputs, args.dim),
            )
        else:
            checked = None
        results.append({
            "variant": variant, "hosts": topo.num_hosts, "ranks_per_host": topo.local_world_size,
            "step_ms": round(wall.item() / args.steps * 1e3, 2), **bytes_,
            "checked_inter": None if checked is None else {"what": checked[0], "measured": checked[1], "closed_form": round(checked[2])},
        })  # fmt: skip
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(results))
    shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topologies", nargs="+", default=["2x2", "4x1"], help="HOSTSxRANKS")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=2048, help="global batch")
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--vocab", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=32)
    add_worker_args(p)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    OUT.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="recscale-bench-dmt-") as tmp:
        for topo in args.topologies:
            hosts, local = map(int, topo.split("x"))
            flags = [f"--{k}={getattr(args, k)}" for k in ("steps", "batch", "features", "vocab", "dim")]
            results += run_workers(
                __file__, flags, Path(tmp) / topo, Path(tmp) / f"{topo}.json", hosts * local, local
            )
    (OUT / "dmt.json").write_text(json.dumps(results, indent=2))
    print("| hosts x ranks | variant | intra bytes/step | inter bytes/step | checked inter bytes: measured / closed form "
          "| step ms (measured) | " + " | ".join(f"step ms at {k}" for k in BANDWIDTHS) + " |")  # fmt: skip
    print("|---" * (6 + len(BANDWIDTHS)) + "|")
    for r in results:
        c = r["checked_inter"]
        checked = f"{c['what']}: {c['measured']:,} / {c['closed_form']:,}" if c else "-"
        modelled = [
            r["step_ms"] + r["comm_inter_bytes"] / r["hosts"] / bw * 1e3 for bw in BANDWIDTHS.values()
        ]
        print(f"| {r['hosts']} x {r['ranks_per_host']} | {r['variant']} | {r['comm_intra_bytes']:,} | "
              f"{r['comm_inter_bytes']:,} | {checked} | {r['step_ms']} | "
              + " | ".join(f"{m:.1f}" for m in modelled) + " |")  # fmt: skip


if __name__ == "__main__":
    main()
