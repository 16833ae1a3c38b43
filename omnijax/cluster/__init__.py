"""omnijax.cluster"""
