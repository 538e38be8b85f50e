"""The model runner: loads a causal LM and runs prefill and decoding over explicit KV tensors.

Sits below ``scheduler`` and ``app``; knows nothing of HTTP, storage or codecs.
"""

from engine.loading import LoadedModel, load_model
from engine.runner import ModelRunner

__all__ = ["LoadedModel", "ModelRunner", "load_model"]
