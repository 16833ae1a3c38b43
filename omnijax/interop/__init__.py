"""omnijax.interop"""
