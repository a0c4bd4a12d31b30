"""Distributed training benchmark: examples/s and a step-time breakdown for 1, 2 and 4 processes.

    python bench/distributed.py                        # 1, 2, 4 processes (4 = 2 hosts x 2 ranks)
    python bench/distributed.py --nprocs 1 2 --steps 20 --sharding row_wise --dense fsdp

Every world size trains the same model on the same global batch (``--batch``), so the ranks split it;
each rank runs this file's worker through ``recscale.distributed.launch`` (the launcher behind
``recscale train --nproc``) and builds the real trainer (data, DMP, optimizers). Batches are gathered
before timing, so the figures are the model's step, without the input pipeline.

Two timed passes per world size, after warm-up:

1. throughput: plain training steps; examples/s = steps x global batch / wall time.
2. breakdown (instrumented, so its steps are slower than pass 1): collectives wait inline and are
   timed (communication, including waiting for slower ranks); the self time of fbgemm's ops from the
   profiler (embedding lookup: forward, backward with the fused table update, index permutes and
   bounds checks); ``optimizer.step()`` timed (the dense optimizer); dense forward/backward is the
   rest of the step (model compute and TorchRec's glue). Averaged over ranks.

Writes runs/bench/distributed.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from rank_workers import OUT, REPO, add_worker_args, rank_batches, run_workers  # bench/ is on sys.path


def _overrides(args: argparse.Namespace) -> list[str]:
    return [
        "data.synthetic.rows.train=200000", "data.synthetic.rows.valid=1024", "data.synthetic.rows.test=1024",
        f"data.synthetic.vocab_sizes={args.vocab}", "data.num_workers=0", "train.progress=false",
        f"train.batch_size={args.batch}", f"model.embedding.dim={args.dim}",
        f"distributed.sharding={args.sharding}", f"distributed.dense={args.dense}", "distributed.count_bytes=true",
    ]  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from recscale.config import load_config
    from recscale.distributed import comms
    from recscale.distributed.env import shutdown
    from recscale.train.loop import Trainer

    logging.disable(logging.WARNING)
    cfg = load_config(REPO / "configs" / "demo.yaml", _overrides(args))
    run_dir = Path(args.run_dir)
    trainer = Trainer(cfg, run_dir, resume=(run_dir / "config.yaml").is_file())  # data made once, reused
    env, meter = trainer.env, trainer.comm
    batches = rank_batches(trainer, args.batch, args.steps)
    timings = {"optimizer": 0.0}

    step, optimizer_step = trainer.train_step, trainer.opt.step

    def timed_optimizer_step() -> None:  # the step training runs, with its optimizer step timed
        t0 = time.perf_counter()
        optimizer_step()
        timings["optimizer"] += time.perf_counter() - t0

    trainer.opt.step = timed_optimizer_step

    def timed(n: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(n):
            step(batches[i % len(batches)])
        dist.barrier()
        return time.perf_counter() - t0

    for b in batches[:3]:  # warm-up
        step(b)
    meter.reset()
    wall = timed(args.steps)
    meter.reset()
    meter.sync, timings["optimizer"] = True, 0.0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        instrumented = timed(args.steps)
    lookup = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("fbgemm::")) / 1e6
    parts = {"embedding": lookup, "communication": meter.seconds, "optimizer": timings["optimizer"]}
    parts["dense"] = instrumented - sum(parts.values())
    local = torch.tensor([wall, *(parts[k] for k in ("embedding", "communication", "dense", "optimizer")),
                          *meter.totals().flatten()], dtype=torch.float64)  # fmt: skip
    local = local.to(env.device)  # NCCL reduces device tensors only
    dist.all_reduce(local)
    local = local.cpu()
    if env.is_main:
        w, n = env.world_size, args.steps
        ms = (local[1:5] / w / n * 1e3).tolist()
        names = ("embedding", "communication", "dense", "optimizer")
        result = {
            "nproc": w,
            "hosts": env.topology.num_hosts,
            "parameters": trainer.built.parameters,
            "examples_per_s": round(n * args.batch / (local[0].item() / w), 1),
            "step_ms": round(local[0].item() / w / n * 1e3, 2),
            "breakdown_ms": {k: round(x, 2) for k, x in zip(names, ms, strict=True)},
            **comms.summarize(local[5:].view(-1, 2), n),  # bytes per step, by collective and host
        }
        Path(args.result).write_text(json.dumps(result))
    shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nprocs", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--local-world-size", type=int, default=2, help="ranks per simulated host (4 = 2 x 2)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=4096, help="global batch")
    p.add_argument("--vocab", type=int, default=100_000, help="ids per table")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--sharding", default="table_wise")
    p.add_argument("--dense", default="ddp", choices=["ddp", "fsdp"])
    add_worker_args(p)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    OUT.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="recscale-bench-") as tmp:
        for n in args.nprocs:
            flags = [
                f"--{k}={getattr(args, k)}" for k in ("steps", "batch", "vocab", "dim", "sharding", "dense")
            ]
            local = min(n, args.local_world_size) if n % args.local_world_size == 0 else n
            results.append(run_workers(__file__, flags, Path(tmp) / "run", Path(tmp) / f"{n}.json", n, local))
            print(json.dumps(results[-1]), flush=True)
    (OUT / "distributed.json").write_text(json.dumps(results, indent=2))
    print("\n| processes | hosts x ranks | examples/s | step ms | embedding | communication | dense fwd/bwd "
          "| optimizer | bytes/step intra | bytes/step inter |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        b, c = r["breakdown_ms"], {"intra": r["comm_intra_bytes"], "inter": r["comm_inter_bytes"]}
        print(f"| {r['nproc']} | {r['hosts']} x {r['nproc'] // r['hosts']} | {r['examples_per_s']:,.0f} | "
              f"{r['step_ms']} | {b['embedding']} | {b['communication']} | {b['dense']} | {b['optimizer']} | "
              f"{c['intra']:,} | {c['inter']:,} |")  # fmt: skip


if __name__ == "__main__":
    main()
