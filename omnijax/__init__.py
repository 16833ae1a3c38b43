"""omnijax: a JAX/XLA trainer for multimodal LLMs under dynamic workloads."""

__version__ = "0.1.0"

import os as _os
import sys as _sys

# Model code annotates params with *logical* axis names; omnijax/parallel maps them to meshes. Set through
# the variable flax reads when it is first imported, so that `import omnijax.errors` (the command line, the
# launcher, a supervisor) does not import jax; directly when flax came first.
_os.environ["FLAX_ALWAYS_SHARD_VARIABLE"] = "false"
if "flax" in _sys.modules:
    _sys.modules["flax"].config.update("flax_always_shard_variable", False)
