"""Model registry: name -> (model class, params class). ``import recscale.models`` fills it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
from pydantic import BaseModel

from recscale.models.base import RecModel
from recscale.models.embedding import EmbeddingConfig, FeatureSet


class ModelClass(Protocol):
    """A registered model class: ``cls(features, embedding, params, device=None)``."""

    def __call__(
        self,
        features: FeatureSet,
        embedding: EmbeddingConfig,
        params: Any,
        device: torch.device | None = None,
    ) -> RecModel: ...


_M = TypeVar("_M", bound=ModelClass)
_REGISTRY: dict[str, tuple[ModelClass, type[BaseModel]]] = {}


def register(name: str, params: type[BaseModel]) -> Callable[[_M], _M]:
    """Class decorator: ``cls(features, embedding, params, device=None)`` becomes buildable as ``name``."""

    def decorate(cls: _M) -> _M:
        if name in _REGISTRY:
            raise ValueError(f"model '{name}' is already registered")
        _REGISTRY[name] = (cls, params)
        return cls

    return decorate


def model_names() -> list[str]:
    return sorted(_REGISTRY)


def _lookup(name: str) -> tuple[ModelClass, type[BaseModel]]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown model '{name}'; known models: {', '.join(model_names())}")
    return _REGISTRY[name]


def params_class(name: str) -> type[BaseModel]:
    return _lookup(name)[1]


def build_model(
    name: str,
    features: FeatureSet,
    embedding: EmbeddingConfig,
    params: BaseModel | dict,
    device: torch.device | None = None,
) -> RecModel:
    """Build model ``name``; ``params`` is its params class or a dict validated into it."""
    cls, params_cls = _lookup(name)
    if isinstance(params, dict):
        params = params_cls.model_validate(params)
    elif not isinstance(params, params_cls):
        raise ValueError(f"model '{name}' takes {params_cls.__name__}, got {type(params).__name__}")
    return cls(features, embedding, params, device=device)
