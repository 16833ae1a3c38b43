"""omnijax.parallel"""
