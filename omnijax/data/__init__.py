"""omnijax.data"""
