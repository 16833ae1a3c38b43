"""omnijax: a JAX/XLA trainer for multimodal LLMs under dynamic workloads."""

__version__ = "0.1.0"
