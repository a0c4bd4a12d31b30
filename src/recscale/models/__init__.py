"""CTR models. Importing this package registers every model with the registry.

A model is ``model(dense (B, n_dense) float32, sparse KeyedJaggedTensor) -> logits (B,)``, holds its
``EmbeddingLayer`` as ``model.embedding`` and reports ``flops_per_example()``.
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
