"""CTR models. Importing this package registers every model with the registry.

A model is ``model(dense (B, n_dense) float, sparse KeyedJaggedTensor) -> logits (B,) float32``, holds
its ``EmbeddingLayer`` as ``model.embedding`` (whose docstring says what inputs it takes) and reports
``flops_per_example()``.

Compiling: ``torch.compile`` takes ``model.interact`` (what ``train.compile`` compiles), and
``torch.export.export`` (non-strict) a whole model. ``torch.fx.symbolic_trace`` (TorchRec's fx-based
inference path) does not, as the embedding layer branches in Python on the KJT (its ids' dtype, its
weights), nor does ``torch.jit.script``.
"""

from recscale.models import autoint, dcnv2, dhen, dlrm, finalmlp, fm, lr, masknet, wukong, xdeepfm  # noqa: F401
from recscale.models.base import ModelParams, RecModel
from recscale.models.embedding import EmbeddingConfig, EmbeddingLayer, FeatureSet, SparseInput
from recscale.models.registry import build_model, model_names, params_class, register

__all__ = [
    "EmbeddingConfig",
    "EmbeddingLayer",
    "FeatureSet",
    "ModelParams",
    "RecModel",
    "SparseInput",
    "build_model",
    "model_names",
    "params_class",
    "register",
]
