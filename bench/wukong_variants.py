"""Restructurings of the Wukong layer tried for bf16 speed (issue 20), against the model's own layer, in one
process: the suite's dense network (``configs/frappe/wukong.yaml``, random X0 of Frappe's shape, batch 4096)
trains forward + backward under bf16 autocast, the two layer forwards alternating step by step so that drift
of a shared machine hits both alike; min and median ms per step after 5 warm-up pairs.

    python bench/wukong_variants.py stacked        # the products that share X on the left as one bmm
    python bench/wukong_variants.py compiled_norm  # residual add + LayerNorm through torch.compile
    OMP_NUM_THREADS=1 python bench/wukong_variants.py embedding_major --cpu-time  # (n, B, d) layout: shared
                                                   # weights as one GEMM each; CPU time, for a busy machine

None is in the model (docs/BENCHMARKS.md, "Restructurings of the Wukong layer").
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

from recscale.models.blocks.cast import as_compute, batched_weight
from recscale.models.wukong import Wukong, WukongLayer
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


def _layers(forward: Callable[[WukongLayer, Tensor], Tensor]) -> Callable[[Wukong, Tensor], Tensor]:
    """The model's ``interact`` with each layer run by ``forward``."""

    def interact(model: Wukong, x0: Tensor) -> Tensor:
        x = as_compute(x0)
        for layer in model.layers:
            x = forward(layer, x)
        return model.head(x.flatten(1)).squeeze(-1)

    return interact


def _mix(weight: Tensor, x: Tensor) -> Tensor:
    """(o, n) weight, (n, B, d) embeddings -> (o, B, d): one GEMM over every example's embeddings."""
    n, b, d = x.shape
    return torch.mm(weight, x.view(n, b * d)).view(-1, b, d)


def _embedding_major_layer(layer: WukongLayer, x: Tensor) -> Tensor:
    """A Wukong layer on (n, B, d) embeddings: Yᵀ X, W_L X and the residual's W_r X, whose weight every example
    shares, as one GEMM (output rows in contiguous blocks); only X (Xᵀ Y) stays a per-example product."""
    fm, n_f, d = layer.fmb.fm, layer.fmb.mlp.out_features, x.shape[2]
    weights = [fm.y.t(), layer.lcb.weight]
    if not isinstance(layer.residual, nn.Identity):
        weights.append(layer.residual.weight)
    mixed = _mix(torch.cat(weights), x)
    k, n_l = fm.k, layer.lcb.n_out
    zt, lcb = mixed[:k], mixed[k : k + n_l]
    residual = x if isinstance(layer.residual, nn.Identity) else mixed[k + n_l :]
    products = torch.bmm(x.transpose(0, 1), zt.permute(1, 2, 0))  # (B, n, d) @ (B, d, k), strided views
    fmb = layer.fmb.mlp(layer.fmb.norm(products.flatten(1))).view(x.shape[1], n_f // d, d)
    return layer.norm(torch.cat([fmb.transpose(0, 1), lcb]) + residual)


def embedding_major(model: Wukong, x0: Tensor) -> Tensor:
    """Every layer on (n, B, d) embeddings (``_embedding_major_layer``): one copy of X0 into that layout, one
    of the last layer's output back for the head."""
    x = as_compute(x0).transpose(0, 1).contiguous()
    for layer in model.layers:
        x = _embedding_major_layer(layer, x)
    return model.head(x.transpose(0, 1).flatten(1)).squeeze(-1)


VARIANTS: dict[str, Callable[[Wukong, Tensor], Tensor]] = {
    "stacked": _layers(stacked),
    "compiled_norm": _layers(compiled_norm),
    "embedding_major": embedding_major,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("variant", choices=sorted(VARIANTS))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--cpu-time", action="store_true",
                   help="time steps by this process's CPU time (run it at OMP_NUM_THREADS=1): other jobs on a "
                        "busy machine then do not count")  # fmt: skip
    args = p.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.steps <= WARMUP:
        p.error(f"--steps must be more than the {WARMUP} warm-up steps")
    model, n, d = dense_model("wukong", torch.device("cpu"))
    assert isinstance(model, Wukong)
    torch.manual_seed(1)
    x0, y = torch.randn(4096, n, d), torch.randint(0, 2, (4096,)).float()
    interacts = {"model": Wukong.interact, args.variant: VARIANTS[args.variant]}
    model.eval()  # the variant computes the model's function: fp32 logits equal up to summation order
    with torch.no_grad():
        want, got = (f(model, x0[:256]) for f in interacts.values())
    model.train()
    print(f"max |logit difference| in fp32: {float((want - got).abs().max()):.2e}")

    def step(interact: Callable[[Wukong, Tensor], Tensor]) -> float:
        t = clock()
        with autocast("bf16", torch.device("cpu")):
            logits = interact(model, x0)
        model.zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(logits.float(), y).backward()
        return clock() - t

    times: dict[str, list[float]] = {name: [] for name in interacts}
    for _ in range(args.steps):
        for name, interact in interacts.items():
            times[name].append(step(interact))
    for name, ts in times.items():
        ts = ts[WARMUP:]
        print(f"{name:14s} min {min(ts) * 1e3:6.1f} ms  median {statistics.median(ts) * 1e3:6.1f} ms")
    base, new = (times[name][WARMUP:] for name in interacts)
    print(f"speed-up of {args.variant}: min {min(base) / min(new):.2f}x, median "
          f"{statistics.median(base) / statistics.median(new):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
