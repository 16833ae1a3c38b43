"""omnijax.models"""
