"""How a release worker names what a release cannot do with a case (runs inside a release
worker only): :class:`Unsupported` (the release cannot express the layout: a kind or an engine
knob it lacks), :class:`Refused` (its planner refused the engine at start-up), and the frame of
vLLM's own code an exception came from (:func:`innermost_vllm_frame`, :func:`refusal`), which
the config probe's errors and the planner's refusals name.
"""

from __future__ import annotations

import importlib
import os
import traceback

class Unsupported(Exception):
    """The release cannot express this layout (a kind or an engine knob it lacks)."""


class Refused(Exception):
    """The release's planner refused the engine at start-up (its ValueError's message)."""


def raised_in(exc: BaseException, function: str) -> bool:
    """Whether ``function`` is on the traceback of ``exc`` (the check that refused)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False


def innermost_vllm_frame(exc: BaseException, vllm_dir: str) -> traceback.FrameSummary | None:
    """The innermost frame of ``exc``'s traceback in vLLM's own code (``vllm_dir``): the
    function that raised, or refused."""
    prefix = vllm_dir + os.sep
    inner = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if os.path.abspath(frame.filename).startswith(prefix):
            inner = frame
    return inner


def refusal(exc: BaseException) -> str:
    """A planner's refusal in one line: the exception, the vLLM function that raised it, and its
    message."""
    vllm_dir = os.path.dirname(os.path.abspath(importlib.import_module("vllm").__file__))
    inner = innermost_vllm_frame(exc, vllm_dir)
    function = inner.name if inner is not None else "?"
    return f"{type(exc).__name__} in {function}: {' '.join(str(exc).split())}"
