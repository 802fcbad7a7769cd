"""dlmjax: fast decoding for diffusion language models in JAX/Flax."""

from dlmjax.arithmetic import numerics
from dlmjax.config import ConfigError, ModelConfig
from dlmjax.io.hf import export_model, load_config, load_model
from dlmjax.models import KVCache, ModelOutput, Transformer, init_model
from dlmjax.sharding import ShardingRules, make_mesh

__version__ = "0.1.0"
__all__ = [
    "ConfigError", "KVCache", "ModelConfig", "ModelOutput", "ShardingRules", "Transformer",
    "export_model", "init_model", "load_config", "load_model", "make_mesh", "numerics",
]
