"""The error every model loader raises for a model servekit cannot serve (its own module, so that
the encoder families' modules can raise it without importing each other)."""
from __future__ import annotations


class UnsupportedModel(ValueError):
    """A model servekit cannot serve: the message names what and why."""
