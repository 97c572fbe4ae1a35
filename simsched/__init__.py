"""simsched: a simulator and fuzzer for vLLM's native KV offloading scheduler.

The model modules named in ``COMPILED`` are compiled with mypyc when the package is installed
(``setup.py``; ``SIMSCHED_PURE=1`` at install builds without compiling). Their ``.py`` files
stay the readable specification: with ``SIMSCHED_PURE=1`` in the environment at run time they
are imported from source even where compiled modules sit beside them.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

#: model modules compiled at install, in the package ``simsched``
COMPILED = ("allocator", "case", "events", "geometry", "invariants", "layout", "model", "offload",
            "shadow", "trace")


class PureSource(importlib.abc.MetaPathFinder):
    """Finds the ``COMPILED`` modules' Python source, ahead of any compiled module."""

    def find_spec(self, fullname, path=None, target=None):
        pkg, _, mod = fullname.partition(".")
        if pkg == "simsched" and mod in COMPILED:
            return importlib.util.spec_from_file_location(
                fullname, Path(__file__).with_name(mod + ".py"))
        return None


def compiled() -> bool:
    """Whether the imported model modules are the compiled ones."""
    from simsched import model
    return not str(model.__file__).endswith(".py")


if os.environ.get("SIMSCHED_PURE") == "1":
    sys.meta_path.insert(0, PureSource())
