"""Prefect flows: one per method, plus audit and sweeps."""
