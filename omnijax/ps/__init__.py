"""omnijax.ps"""
