"""Closed forms: pure functions of a model's sizes (no torch)."""
