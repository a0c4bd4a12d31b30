"""Restructurings of the Wukong layer tried for bf16 speed (issue 20), against the model's own layer, in one
process: the suite's dense network (``configs/frappe/wukong.yaml``, random X0 of Frappe's shape, batch 4096)
trains forward + backward under bf16 autocast, the two layer forwards alternating step by step so that drift
of a shared machine hits both alike; min and median ms per step after 5 warm-up pairs.

    python bench/wukong_variants.py stacked        # the products that share X on the left as one bmm
    python bench/wukong_variants.py compiled_norm  # residual add + LayerNorm through torch.compile

Neither is in the model (docs/BENCHMARKS.md, "Two restructurings of the Wukong layer").
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from dense_step import dense_model  # bench/dense_step.py (this script's folder is on sys.path)
from torch import Tensor, nn

from recscale.models.blocks.cast import batched_weight
from recscale.models.wukong import WukongLayer
from recscale.train.precision import autocast

WARMUP = 5  # step pairs dropped before the min and median


def stacked(layer: WukongLayer, x: Tensor) -> Tensor:
    """Yᵀ X (the FM's first product), W_L X (the LCB) and the residual's W_r X as one per-example product."""
    fm = layer.fmb.fm
    weights = [fm.y.t(), layer.lcb.weight]
    if not isinstance(layer.residual, nn.Identity):
        weights.append(layer.residual.weight)
    left = torch.bmm(batched_weight(torch.cat(weights), x), x)
    k, n_l = fm.k, layer.lcb.n_out
    zt, lcb = left[:, :k], left[:, k : k + n_l]
    residual = x if isinstance(layer.residual, nn.Identity) else left[:, k + n_l :]
    fmb = layer.fmb.mlp(layer.fmb.norm(torch.bmm(x, zt.transpose(1, 2)).flatten(1)))
    return layer.norm(torch.cat([fmb.view(x.shape[0], -1, layer.fmb.dim), lcb], dim=1) + residual)


@torch.compile(dynamic=False)
def _add_norm(a: Tensor, r: Tensor, w: Tensor, b: Tensor) -> Tensor:
    return F.layer_norm(a + r, (a.shape[-1],), w, b)


def compiled_norm(layer: WukongLayer, x: Tensor) -> Tensor:
    out = torch.cat([layer.fmb(x), layer.lcb(x)], dim=1)
    return _add_norm(out, layer.residual(x), layer.norm.weight, layer.norm.bias)


VARIANTS: dict[str, Callable[[WukongLayer, Tensor], Tensor]] = {
    "stacked": stacked,
    "compiled_norm": compiled_norm,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variant", choices=sorted(VARIANTS))
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    if args.steps <= WARMUP:
        p.error(f"--steps must be more than the {WARMUP} warm-up steps")
    model, n, d = dense_model("wukong", torch.device("cpu"))
    torch.manual_seed(1)
    x0, y = torch.randn(4096, n, d), torch.randint(0, 2, (4096,)).float()
    forwards = {"model": WukongLayer.forward, args.variant: VARIANTS[args.variant]}

    def step(forward: Callable[[WukongLayer, Tensor], Tensor]) -> float:
        WukongLayer.forward = forward
        t = time.perf_counter()
        with autocast("bf16", torch.device("cpu")):
            logits = model.interact(x0)
        model.zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(logits.float(), y).backward()
        return time.perf_counter() - t

    times: dict[str, list[float]] = {name: [] for name in forwards}
    for _ in range(args.steps):
        for name, forward in forwards.items():
            times[name].append(step(forward))
    for name, ts in times.items():
        ts = ts[WARMUP:]
        print(f"{name:14s} min {min(ts) * 1e3:6.1f} ms  median {statistics.median(ts) * 1e3:6.1f} ms")
    base, new = (times[name][WARMUP:] for name in forwards)
    print(f"speed-up of {args.variant}: min {min(base) / min(new):.2f}x, median "
          f"{statistics.median(base) / statistics.median(new):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
