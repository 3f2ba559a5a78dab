"""The one guard of the rule that torch.compile is not thread-safe: compiling, and calling
compiled code, happen on the main thread of the process only."""

from __future__ import annotations

import threading

import torch


def require_main_thread(what: str) -> None:
    """Raise unless called from the main thread. Inside a graph being traced it does nothing:
    the eager caller already passed it, and dynamo cannot trace ``threading`` (it would break
    the graph at every call)."""
    if torch.compiler.is_compiling():
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            f"{what} must run on the main thread (called from {threading.current_thread().name!r}): "
            "torch.compile is not thread-safe"
        )
