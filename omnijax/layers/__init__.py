"""omnijax.layers"""
