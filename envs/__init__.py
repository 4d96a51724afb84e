"""Gymnasium-style multi-turn tool environments."""

from __future__ import annotations
