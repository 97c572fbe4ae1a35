"""simsched: a simulator and fuzzer for vLLM's native KV offloading scheduler.

The model modules named in ``COMPILED`` are compiled with mypyc when the package is installed
(``setup.py``; ``SIMSCHED_PURE=1`` at install builds without compiling). Their ``.py`` files
stay the readable specification: with ``SIMSCHED_PURE=1`` in the environment at run time they
are imported from source even where compiled modules sit beside them, and so they are, with a
warning, when the compiled modules are stale (a source edited after the build, or a compiled
module missing): the compiled modules are one build, used all together or not at all.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import warnings
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

#: modules compiled at install, by their paths in the package ``simsched`` (the model's, and the
#: case, layout, geometry and oracles it runs with). Not ``profiles``: a campaign reads a profile
#: through a :class:`~simsched.profiles.RecordingProfile`, whose attribute reads a compiled class
#: would not let it see.
COMPILED = ("case", "geometry", "invariants", "layout", "shadow", "trace",
            "model/async_scheduler", "model/block_pool", "model/cpu_manager", "model/events",
            "model/kv_cache_manager", "model/multi_connector", "model/nixl_scheduler",
            "model/offloading_common", "model/offloading_scheduler", "model/request", "model/run",
            "model/scheduler", "model/simple_cpu_scheduler", "model/simple_cpu_scheduler_legacy",
            "model/single_type_kv_cache_manager", "model/tiering_manager", "model/fs_tier")


class PureSource(importlib.abc.MetaPathFinder):
    """Finds the ``COMPILED`` modules' Python source, ahead of any compiled module."""

    def find_spec(self, fullname, path=None, target=None):
        pkg, _, mod = fullname.partition(".")
        if pkg == "simsched" and mod.replace(".", "/") in COMPILED:
            return importlib.util.spec_from_file_location(
                fullname, Path(__file__).parent / (mod.replace(".", "/") + ".py"))
        return None


def compiled() -> bool:
    """Whether the imported model modules are the compiled ones."""
    from simsched.model import scheduler
    return not str(scheduler.__file__).endswith(".py")


def _stale() -> bool:
    """Compiled modules beside the sources, but not all of them or older than a source."""
    here = Path(__file__).parent
    # mypyc puts the compiled code of every module in one shared library beside the package
    # (``<hash>__mypyc.<suffix>``); each module's own extension is a small shim that loads it.
    # An in-place rebuild (``setup.py build_ext --inplace``) rewrites the library but may leave
    # an unchanged shim with its old time: a module is built when its shim or the library is.
    lib = max((p.stat().st_mtime for p in here.parent.glob("*__mypyc*")
               if p.name.endswith(tuple(EXTENSION_SUFFIXES))), default=None)
    built = []
    for m in COMPILED:
        times = [p.stat().st_mtime for p in (here / (m + s) for s in EXTENSION_SUFFIXES)
                 if p.exists()]
        if times and lib is not None:
            times.append(lib)
        built.append(max(times) if times else None)
    if all(b is None for b in built):
        return False                               # not compiled: sources import anyway
    return any(b is None or (here / (m + ".py")).stat().st_mtime > b
               for m, b in zip(COMPILED, built))


if os.environ.get("SIMSCHED_PURE") == "1":
    sys.meta_path.insert(0, PureSource())
elif _stale():
    warnings.warn("simsched: compiled model modules older than their sources (or incomplete); "
                  "running the sources. Reinstall (pip install -e .) to compile them again.",
                  stacklevel=2)
    sys.meta_path.insert(0, PureSource())
