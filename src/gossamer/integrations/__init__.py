"""Integrations of gossamer with training frameworks.

- :mod:`gossamer.integrations.lightning`: :class:`GossamerStrategy`, a PyTorch Lightning
  strategy that runs any of gossamer's methods (``pip install gossamer[lightning]``).
- Hugging Face Accelerate needs no code of its own: see the recipe in ``docs/integrations.md``.

Importing this package imports no framework: ``GossamerStrategy`` is loaded (with Lightning)
when it is first used, so that ``import gossamer`` stays as light as it is without them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GossamerStrategy"]


def __getattr__(name: str) -> Any:
    if name == "GossamerStrategy":
        from gossamer.integrations.lightning import GossamerStrategy

        return GossamerStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
