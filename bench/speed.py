"""Training speed: examples/s and dense FLOP utilisation of Wukong, DLRM and DCNv2 at two sizes.

    OMP_NUM_THREADS=1 python bench/speed.py                     # prints one JSON line
    OMP_NUM_THREADS=1 python bench/speed.py --models wukong --compile   # with and without torch.compile
    python bench/speed.py --models wukong --sizes frappe --precision fp32 bf16   # train.precision

Sizes: ``frappe`` is the model section of configs/frappe.yaml (Wukong's defaults, d = 16) on synthetic
data shaped like Frappe (10 single-id fields); ``mid`` is ~10 MFLOP/example (forward) on synthetic data
with 32 single-id and 4 dense fields. Each model trains through the real ``Trainer`` (DMP, fused table
optimizer, dense Adam); batches are built before timing, so this is the training step alone.

Utilisation = achieved training FLOP/s (3 x the analytic forward FLOPs per example x examples/s) /
the matmul peak of the run's precision: the best fp32 (bf16) ``torch.mm`` rate over square sizes 512,
1024 and 2048, at the same thread count, measured in the same run before and after the models (the
better of the two is kept, so a busy machine lowers the peak no more than the models).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# ~10 MFLOP/example forward on the 32 + 4 field data (analytic counts of recscale.models).
MID = {
    "wukong": ["model.num_layers=2", "model.n_f=32", "model.n_l=32", "model.k=32",
               "model.fmb_mlp=[1024]", "model.final_mlp=[1024]"],
    "dlrm": ["model.top_mlp=[2048,1024,1024,512]"],
    "dcnv2": ["model.mlp=[1536,1024,1024]", "model.num_cross_layers=3"],
}  # fmt: skip
DATA = {
    "frappe": ["data.synthetic.num_sparse=10", "data.synthetic.num_multi=0", "data.synthetic.num_dense=0"],
    "mid": ["data.synthetic.num_sparse=32", "data.synthetic.num_multi=0", "data.synthetic.num_dense=4"],
}


def matmul_peak(
    threads_note: dict, repeats: int = 3, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> float:
    """Best GFLOP/s of torch.mm on square matrices of ``dtype`` (the machine's practical matmul peak).
    On CUDA the sizes go up to 8192 (smaller products do not fill a GPU) and each product is synchronised."""
    best = 0.0
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for n in (512, 1024, 2048, *((4096, 8192) if device != "cpu" else ())):
        a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
        torch.mm(a, b)
        sync()
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            sync()
            best = max(best, 2 * n**3 / (time.perf_counter() - t0) / 1e9)
    threads_note["threads"] = torch.get_num_threads()
    return best


def build_trainer(model: str, size: str, batch: int, steps: int, run_dir: Path, extra: list[str]):
    from recscale.config import load_config
    from recscale.train.loop import Trainer

    frappe = load_config(REPO / "configs" / "frappe.yaml")
    overrides = [
        "data.format=synthetic", "data.num_workers=0", "data.synthetic.vocab_sizes=1000",
        f"data.synthetic.rows={{train: {batch * steps}, valid: 1024, test: 1024}}",
        f"model.name={model}", f"model.embedding.dim={frappe.model.embedding.dim}",
        f"train.batch_size={batch}", "train.progress=false", *DATA[size], *(MID[model] if size == "mid" else []),
        *extra,
    ]  # fmt: skip
    cfg = load_config(REPO / "configs" / "demo.yaml", overrides)
    return Trainer(cfg, run_dir)


def measure(trainer, batch: int, steps: int, warmup: int) -> dict:
    from recscale.data.dataset import epoch_batches, iterate
    from recscale.models.flops import TRAIN_FLOPS_MULTIPLIER

    index = epoch_batches(len(trainer.train_ds), batch, seed=0, epoch=0, drop_last=True)
    batches = list(iterate(trainer.train_ds, index[:steps]))
    trainer.module.train()
    step = trainer.train_step  # the step training runs (schedule, clipping, regularisers included)

    for i in range(warmup):
        step(batches[i % len(batches)])
    t0 = time.perf_counter()
    for b in batches:
        step(b)
    seconds = time.perf_counter() - t0
    flops = TRAIN_FLOPS_MULTIPLIER * trainer.built.flops_per_example
    rate = len(batches) * batch / seconds
    return {
        "mflops_per_example": round(flops / 3 / 1e6, 3),
        "examples_per_s": round(rate, 1),
        "train_gflops_per_s": round(flops * rate / 1e9, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["wukong", "dlrm", "dcnv2"])
    p.add_argument("--sizes", nargs="+", default=["frappe", "mid"], choices=list(DATA))
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="also measure each model with train.compile=true")
    p.add_argument(
        "--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"], help="train.precision"
    )
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    info: dict = {}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    peaks = {p: matmul_peak(info, dtype=dtypes[p]) for p in args.precision}
    runs = []
    with tempfile.TemporaryDirectory(prefix="recscale-speed-") as tmp:
        for size in args.sizes:
            for model in args.models:
                for compiled, precision in itertools.product(
                    (False, True) if args.compile else (False,), args.precision
                ):
                    run_dir = Path(tmp) / f"{model}-{size}-{compiled}-{precision}"
                    extra = [f"train.precision={precision}", *(["train.compile=true"] if compiled else [])]
                    trainer = build_trainer(model, size, args.batch, args.steps, run_dir, extra)
                    result = measure(trainer, args.batch, args.steps, args.warmup)
                    runs.append(
                        {"model": model, "size": size, "compile": compiled, "precision": precision, **result}
                    )
    peaks = {p: max(peak, matmul_peak(info, dtype=dtypes[p])) for p, peak in peaks.items()}
    for r in runs:  # against the peak of the precision the dense network computes in
        r["utilisation"] = round(r["train_gflops_per_s"] / peaks[r["precision"]], 3)
    print(json.dumps({"bench": "speed", "batch": args.batch, **info,
                      "matmul_peak_gflops": {p: round(v, 1) for p, v in peaks.items()}, "runs": runs}))  # fmt: skip


if __name__ == "__main__":
    main()
