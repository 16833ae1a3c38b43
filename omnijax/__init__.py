"""omnijax: a JAX/XLA trainer for multimodal LLMs under dynamic workloads."""

__version__ = "0.1.0"

import flax as _flax

# Model code annotates params with *logical* axis names; omnijax/parallel maps them to meshes.
_flax.config.update("flax_always_shard_variable", False)
