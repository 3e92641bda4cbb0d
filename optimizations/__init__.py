"""Backend-agnostic PyTorch code: model loading, precision, quantization, compilation, CUDA graphs.

Nothing in this package imports TorchServe, so it can be used and tested without a server.
"""
