"""Kept for existing imports: the terminal report now lives in :mod:`torchledger.render.table`.

Every format (table, json, csv, markdown, sarif, html) is in :mod:`torchledger.render`.
"""
from __future__ import annotations

from .render.table import render_table

__all__ = ["render_table"]
