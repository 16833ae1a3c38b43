"""omnijax.interop: weight import/export (Hugging Face safetensors)."""
