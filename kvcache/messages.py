"""How values appear in error messages: short enough to read and to log, whatever the client sent."""
from __future__ import annotations


def describe(value: object, limit: int = 40) -> str:
    """repr(value), cut to about `limit` characters: an error message must not echo a 4,000-digit number."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"
