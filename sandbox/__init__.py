"""Python execution service: persistent sessions, hard limits, real isolation."""

from __future__ import annotations
