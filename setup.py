"""Build hook: compiles the model modules (``simsched.COMPILED``) with mypyc at install.

``pip install -e .`` (or ``pip install .``) compiles the model's modules (``simsched/model/*.py``,
``invariants.py``, ``shadow.py``, ... as listed) into extension modules beside them (under a
minute of CPU with gcc and the Python headers); the ``.py`` files stay the specification and run
unchanged when
``SIMSCHED_PURE=1`` is set at install (nothing compiled) or at run time (source imported ahead of
the compiled modules, see ``simsched/__init__.py``). Everything else is in ``pyproject.toml``.
"""

import ast
import os
from pathlib import Path

from setuptools import setup

# simsched.COMPILED, read from the source (setup.py does not import the package it builds)
_init = ast.parse((Path(__file__).parent / "simsched" / "__init__.py").read_text())
COMPILED = next(ast.literal_eval(n.value) for n in _init.body
                if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "COMPILED")

ext_modules = []
if os.environ.get("SIMSCHED_PURE") != "1":
    from mypyc.build import mypycify
    ext_modules = mypycify([f"simsched/{m}.py" for m in COMPILED], opt_level="3")

setup(ext_modules=ext_modules)
