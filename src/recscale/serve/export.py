"""``recscale export``: a trained run -> a self-contained inference model (``recscale.serve.artifact``).

The inference model is the run's own network, unsharded and in eval mode, rebuilt from the config by
the model registry. Its tables can be stored quantized through TorchRec's quantized
``EmbeddingBagCollection`` (fbgemm's row-wise int8/int4 with a per-row fp16 scale and bias, or fp16),
which runs on CPU; its dense weight matrices can be stored as bf16 (and then run under bf16 autocast), or as int8: each
row-wise symmetric int8 with an fp32 scale per output row, dequantized to fp32 when the model loads (a
smaller artifact; compute stays fp32). Vectors (biases, norms) and lookups (sequence tables) stay fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.inference.modules import quantize_embeddings
from torchrec.tensor_types import UIntXTensor

from recscale.config import RunConfig
from recscale.data.preprocess import Preprocessor
from recscale.distributed.env import own_group
from recscale.errors import CheckpointError
from recscale.models.base import RecModel
from recscale.models.quant import FORMATS, QuantLinear, fake_quant, quantize_model, quantize_rows
from recscale.models.registry import build_model
from recscale.serve.artifact import DenseFormat, Manifest, TableFormat, check_model_out, write_artifact
from recscale.train.build import feature_set

_QUANT_DTYPES = {"fp16": torch.float16, "int8": torch.qint8, "int4": torch.quint4x2}
_TABLES = "embedding.ebc."  # state-dict prefix of the tables in every RecModel
_SEQUENCE_TABLES = "embedding.ec."  # ... and of the sequence features' tables (per-position lookups)


def inference_model(cfg: RunConfig, pre: Preprocessor, tables: TableFormat) -> RecModel:
    """The run's network, unsharded, in eval mode, tables quantized to ``tables`` (weights not loaded)."""
    model = build_model(cfg.model.name, feature_set(pre), cfg.model.embedding, cfg.model.params)
    if cfg.model.quant is not None:  # the emulated low-precision GEMMs it was trained with
        quantize_model(model, cfg.model.quant)
    if tables != "fp32":
        quantize_embeddings(model, dtype=_QUANT_DTYPES[tables], inplace=True)
    return model.eval()


def _full(name: str, t: torch.Tensor) -> torch.Tensor:
    """A trained model's tensor as one plain tensor (a sharded table assembled from this process's shards)."""
    if isinstance(t, ShardedTensor):
        out = torch.empty(t.size(), dtype=t.dtype)
        covered = 0
        for shard in t.local_shards():
            where = tuple(
                slice(o, o + s)
                for o, s in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes, strict=True)
            )
            out[where] = shard.tensor
            covered += shard.tensor.numel()
        if covered != out.numel():
            raise CheckpointError(f"table {name} is sharded over processes; export from one process")
        return out
    full_tensor = getattr(t, "full_tensor", None)  # an FSDP2 DTensor
    return (full_tensor() if full_tensor is not None else t).detach().cpu()


# Bytes of a quantized table row as fbgemm lays it out before padding the row to 16 bytes: fp16 values;
# row-wise int8/int4: an fp16 scale and bias, then the values. The padding (zeros) is not saved.
_ROW_BYTES = {"fp16": lambda d: 2 * d, "int8": lambda d: 4 + d, "int4": lambda d: 4 + d // 2}


def _row_widths(model: RecModel, tables: TableFormat) -> dict[str, int]:
    if tables == "fp32":
        return {}
    return {
        f"{_TABLES}embedding_bags.{c.name}.weight": _ROW_BYTES[tables](c.embedding_dim)
        for c in model.embedding.ebc.embedding_bag_configs()
    }


def weights(model: RecModel, tables: TableFormat, dense: DenseFormat) -> dict[str, torch.Tensor]:
    """The inference model's tensors to save: quantized tables as their packed rows without padding, the
    dense weights in ``dense``."""
    widths = _row_widths(model, tables)
    lowered = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    # Lookups (a sequence's table, the causal encoder's positions) are no matmul operand that autocast
    # rounds anyway, and no dense matrix: stored bf16 or int8 they would score otherwise than the run.
    lookups = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    out = {}
    for name, t in model.state_dict().items():
        if isinstance(t, UIntXTensor):
            t = t.elem
        matrix = _dense_matrix(name, t) and name not in lookups
        if name in widths:
            t = t[:, : widths[name]]
        elif dense == "bf16" and matrix:
            t = _bf16(t, lowered.get(name))
        elif dense == "int8" and matrix:
            t, out[name + _SCALE] = quantize_rows(t.detach())
        out[name] = t.detach().contiguous()
    return out


def _bf16(t: torch.Tensor, layer: QuantLinear | None) -> torch.Tensor:
    """A dense matrix as ``--dense bf16`` stores it. A layer lowered by ``model.quant`` computes with
    fq(W), not W: rounding W to bf16 first moves fq(W) (block maxima and grid points shift), so it stores
    fq(W) itself, which bf16 holds exactly for the MX formats (at most 8 significant bits, scales within
    fp32's exponents) and fq is idempotent: the export scores as the run. Per-tensor FP8 (an fp32 scale)
    and fp16 grids bf16 cannot hold: such a layer keeps its fp32 weight."""
    if layer is None or layer.fmt == "bf16":
        return t.to(torch.bfloat16)
    if FORMATS[layer.fmt].kind == "mx":
        return fake_quant(t, layer.fmt, layer.block).to(torch.bfloat16)
    return t


_SCALE = ".int8_scale"  # the per-row fp32 scale saved beside an int8 dense weight


def _dense_matrix(name: str, t: torch.Tensor) -> bool:
    """A dense weight matrix (2-D or more, float): stored bf16 or int8 by ``--dense``. Vectors (biases,
    norms, the calibration) stay fp32, as a bf16 run computes them under autocast, so its bf16 export
    scores as its eval does."""
    return not name.startswith(_TABLES) and t.is_floating_point() and t.ndim >= 2


def _dequantize_dense(tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The saved tensors with each int8 dense weight and its scale turned back into one fp32 tensor."""
    out = {k: v for k, v in tensors.items() if not k.endswith(_SCALE)}
    for name, q in out.items():
        if q.dtype != torch.int8 or name.startswith(_TABLES):
            continue
        scale = tensors.get(name + _SCALE)
        if scale is None or scale.dtype != torch.float32 or scale.shape != (q.shape[0],):
            raise CheckpointError(f"{where}: int8 tensor {name} has no fp32 scale per row; export it again")
        out[name] = (q.float().reshape(q.shape[0], -1) * scale[:, None]).reshape(q.shape)
    return out


@torch.no_grad()
def load_weights(model: RecModel, tensors: dict[str, torch.Tensor], tables: TableFormat, where: str) -> None:
    """Copy ``tensors`` (as ``weights`` saved them) into ``model``'s own storage (a quantized table's
    buffers are views of fbgemm's weights); every name, shape and dtype must match."""
    target, widths = model.state_dict(keep_vars=True), _row_widths(model, tables)
    tensors = _dequantize_dense(tensors, where)
    if target.keys() != tensors.keys():
        missing, extra = sorted(target.keys() - tensors.keys()), sorted(tensors.keys() - target.keys())
        raise CheckpointError(
            f"{where}: does not fit the model (missing {missing[:3]}, unexpected {extra[:3]}); export it again"
        )
    for name, t in target.items():
        dst, src = (t.elem if isinstance(t, UIntXTensor) else t), tensors[name]
        if name in widths:
            dst[:, widths[name] :] = 0
            dst = dst[:, : widths[name]]
        upcast = src.dtype == torch.bfloat16 and dst.dtype == torch.float32 and not name.startswith(_TABLES)
        if src.shape != dst.shape or (src.dtype != dst.dtype and not upcast):
            raise CheckpointError(
                f"{where}: tensor {name} is {src.dtype} {tuple(src.shape)}, the model has "
                f"{dst.dtype} {tuple(dst.shape)}; export it again"
            )
        dst.copy_(src)


@own_group()
def export_run(
    run_dir: Path, out: Path, tables: TableFormat = "fp32", dense: DenseFormat = "fp32"
) -> Manifest:
    """Export a trained run's best (else latest) model to the model directory ``out``."""
    from recscale.distributed.dmt.transform import LocalDMT
    from recscale.train.runs import load_trained, refuse_without_flat_form, run_config

    check_model_out(out)  # before the model loads, not after
    refuse_without_flat_form(run_dir, run_config(run_dir), "to export")
    cfg, pre, built = load_trained(run_dir, "to export")
    model = built.model
    state = model.flat_state_dict() if isinstance(model, LocalDMT) else model.state_dict()  # type: ignore[attr-defined]
    trained = {k: _full(k, v) for k, v in state.items()}
    if cfg.model.embedding.storage == "fp16":
        # Tables trained in fp16 storage export as fp32 tables holding the same values, so the manifest's
        # format says what the file holds and scores equal the run's; --tables fp16 halves them again.
        emb = cfg.model.embedding.model_copy(update={"storage": "fp32"})
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"embedding": emb})})
        trained = {
            k: v.float() if k.startswith((_TABLES, _SEQUENCE_TABLES)) else v for k, v in trained.items()
        }
    # The training model (its tables, their optimizer state) and then the assembled tensors are let go as soon
    # as they are copied: each is as large as the tables, and the file written is one more copy.
    del built, model, state
    model = inference_model(cfg, pre, "fp32")
    load_weights(model, trained, "fp32", f"{run_dir}'s checkpoint")
    del trained
    if tables != "fp32":
        quantize_embeddings(model, dtype=_QUANT_DTYPES[tables], inplace=True)
    manifest = Manifest(
        model=cfg.model.name, tables=tables, dense=dense, source=str(Path(run_dir).resolve()), files={}
    )
    return write_artifact(out, cfg, pre, weights(model, tables, dense), manifest)
