"""recscale: training large-scale recommendation models on PyTorch and TorchRec."""

__version__ = "0.1.0"
