"""The dense network's training step alone, fp32 against ``train.precision: bf16``, on any device.

    python bench/dense_step.py                                  # CPU, the Frappe suite configs
    python bench/dense_step.py --device cuda --batch 4096 65536 # a GPU

Why it exists: a GPU machine without fbgemm's CUDA build (the only one lent to this project has a CUDA
torch and nothing of fbgemm/TorchRec's CUDA side) cannot run the real trainer, whose tables are fbgemm
kernels. The dense network is plain torch, so this script builds each model from its suite config
(``configs/frappe/{wukong,dlrm,dcnv2}.yaml``, Frappe's 10 single-id fields), keeps the embedding layer on
the CPU unused, moves everything else to ``--device`` and trains ``model.interact`` on random X0
(B, n, d): forward under ``recscale.train.precision.autocast`` (the trainer's context), loss in fp32
from fp32 logits, backward, Adam (the dense optimizer) on fp32 master weights.

Per model and batch size it reports examples/s for each precision, the bf16/fp32 speed-up, the dense
FLOP utilisation (3 x the analytic forward FLOPs per example x examples/s over the measured matmul peak
of the precision, bench/speed.py's ``matmul_peak``) and checks what mixed precision promises: bf16 and
fp32 probabilities from the same weights agree (max |Δp|), losses and gradients are finite and every
parameter and Adam moment stays fp32. One JSON line; exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
from speed import matmul_peak  # bench/speed.py (this script's folder is on sys.path)

from recscale.config import load_config
from recscale.models import FeatureSet, SparseInput, build_model
from recscale.models.flops import TRAIN_FLOPS_MULTIPLIER, module_flops
from recscale.train.precision import autocast

REPO = Path(__file__).resolve().parents[1]
FRAPPE = FeatureSet(tuple(SparseInput(f"C{i}", 1000, "sum") for i in range(10)), num_dense=0)
# bf16 keeps 8 bits of mantissa: probabilities from the same weights may differ by a few 1e-3, not more.
MAX_ABS_DP = 0.02
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def dense_model(name: str, device: torch.device) -> tuple[torch.nn.Module, int, int]:
    """The suite's model with everything but its embedding layer on ``device``; (model, n, d)."""
    cfg = load_config(REPO / "configs" / "frappe" / f"{name}.yaml")
    torch.manual_seed(0)
    model = build_model(cfg.model.name, FRAPPE, cfg.model.embedding, cfg.model.params)
    for child_name, child in model.named_children():
        if child_name != "embedding":
            child.to(device)
    return model, model.embedding.num_outputs, cfg.model.embedding.dim


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check(model: torch.nn.Module, x0: torch.Tensor, device: torch.device) -> dict:
    """bf16 against fp32 probabilities from the same weights (eval mode: no dropout)."""
    model.eval()
    with torch.no_grad():
        p32 = torch.sigmoid(model.interact(x0))
        with autocast("bf16", device):
            logits = model.interact(x0)
    model.train()
    return {"max_abs_dp": float((torch.sigmoid(logits.float()) - p32).abs().max())}


def train_rate(model: torch.nn.Module, x0: torch.Tensor, precision: str, steps: int, warmup: int) -> dict:
    device = x0.device
    params = [p for n, p in model.named_parameters() if not n.startswith("embedding.")]
    opt = torch.optim.Adam(params, lr=1e-3)
    y = torch.randint(0, 2, (x0.shape[0],), device=device).float()

    def step() -> torch.Tensor:
        with autocast(precision, device):  # type: ignore[arg-type]
            logits = model.interact(x0)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    for _ in range(warmup):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync(device)
    seconds = time.perf_counter() - t0
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return {
        "examples_per_s": round(steps * x0.shape[0] / seconds, 1),
        "loss_finite": bool(torch.isfinite(loss).item()),
        "grads_finite": all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None),
        "master_fp32": all(t.dtype == torch.float32 for t in [*params, *state]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["wukong", "dlrm", "dcnv2"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[4096])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile the dense network (train.compile)")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    info: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "compile": args.compile,
    }
    peaks = {k: matmul_peak(info, dtype=v, device=args.device) for k, v in DTYPES.items()}
    runs: list[dict] = []
    train_flops: list[int] = []  # per row, unrounded
    for name in args.models:
        model, n, d = dense_model(name, device)
        if args.compile:
            model.interact = torch.compile(model.interact)  # type: ignore[method-assign]
        dense = (c for cn, c in model.named_children() if cn != "embedding")
        flops = TRAIN_FLOPS_MULTIPLIER * sum(module_flops(c) for c in dense)
        for batch in args.batch:
            x0 = torch.randn(batch, n, d, device=device) * 0.1
            row: dict = {"model": name, "batch": batch, "train_mflops_per_example": round(flops / 1e6, 2)}
            row.update(check(model, x0, device))
            for precision in DTYPES:
                r = train_rate(model, x0, precision, args.steps, args.warmup)
                row[f"{precision}_examples_per_s"] = r.pop("examples_per_s")
                row[f"{precision}_finite_and_fp32"] = all(r.values())
            row["bf16_speedup"] = round(row["bf16_examples_per_s"] / row["fp32_examples_per_s"], 2)
            runs.append(row)
            train_flops.append(flops)
    peaks = {k: max(v, matmul_peak(info, dtype=DTYPES[k], device=args.device)) for k, v in peaks.items()}
    for row, flops in zip(runs, train_flops, strict=True):  # against the better peak, before or after
        for precision in DTYPES:
            rate = row[f"{precision}_examples_per_s"]
            row[f"{precision}_utilisation"] = round(flops * rate / 1e9 / peaks[precision], 3)
    ok = all(
        r["max_abs_dp"] < MAX_ABS_DP and r["fp32_finite_and_fp32"] and r["bf16_finite_and_fp32"] for r in runs
    )
    print(json.dumps({"bench": "dense_step", **info, "checks_passed": ok,
                      "matmul_peak_gflops": {k: round(v, 1) for k, v in peaks.items()}, "runs": runs}))  # fmt: skip
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
