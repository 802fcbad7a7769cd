"""The decoder stack shared by every family."""

from dlmjax.models.transformer import KVCache, ModelOutput, Transformer, abstract_model, init_model

__all__ = ["KVCache", "ModelOutput", "Transformer", "abstract_model", "init_model"]
