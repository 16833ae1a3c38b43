"""omnijax.train"""
