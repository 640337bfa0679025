"""Shared leaf of the RLHF service: wire format, records, config schemas, model loading.

It imports nothing from the rest of the project (a test enforces this).
"""
