"""kspeedfs: a distributed cache filesystem for deep-learning training data.

The Python library (``client.py``; the reference is docs/api.md)::

    import kspeedfs
    with kspeedfs.open_dataset("imagenet") as ds:
        data = ds.read("train/n01440764/x.JPEG")

Imported lazily, so ``import kspeedfs`` (and the CLI's ``--help``) loads nothing but
this file until a name is used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import Dataset, DatasetFile, open_dataset

__all__ = ["Dataset", "DatasetFile", "open_dataset"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'kspeedfs' has no attribute {name!r}")
