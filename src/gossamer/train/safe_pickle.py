"""Unpickling that can build numpy arrays and nothing else.

CIFAR-10's python batches are pickles, and ``pickle.load`` runs whatever callable a file names
(``os.system`` included), so a downloaded or shared data file could run code. The restricted
unpickler here resolves only the globals that numpy arrays, dtypes and scalars need; dicts, lists,
strings, bytes and numbers need no globals at all.
"""

from __future__ import annotations

import pickle
from typing import IO, Any

# (module, name) pairs a pickled ndarray may name: numpy 1 writes "numpy.core", numpy 2
# "numpy._core"; protocol 5 pickles use _frombuffer instead of _reconstruct.
_ALLOWED = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
}


def _resolve(module: str, name: str) -> Any:
    import numpy as np

    if module == "numpy":
        return getattr(np, name)
    # Map both spellings onto the installed numpy, without importing the deprecated
    # numpy.core shim of numpy 2 (it warns).
    core = getattr(np, "_core", None) or np.core
    submodule = getattr(core, module.rsplit(".", 1)[1])
    return getattr(submodule, name)


class SafeUnpickler(pickle.Unpickler):
    """An unpickler whose ``find_class`` allows only numpy array reconstruction."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: only numpy arrays are allowed"
            )
        return _resolve(module, name)


def safe_load(file: IO[bytes], *, encoding: str = "ASCII") -> Any:
    """Unpickle from an open binary file, refusing every global but numpy array builders.

    Args:
        file: a binary file object.
        encoding: how to decode Python 2 ``str`` objects (default "ASCII", as ``pickle.load``);
            CIFAR-10's batches need ``"bytes"``.

    Raises ``pickle.UnpicklingError`` naming the refused global.
    """
    return SafeUnpickler(file, encoding=encoding).load()
