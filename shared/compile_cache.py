"""The folder where torch.compile keeps its compiled graphs between runs, for both stages
(training's flex-attention graphs, extraction's LM-head reduction).

Inductor's FX graph cache (the generated code with its Triton kernels), the AOTAutograd
cache (forward and backward graphs) and autotuning results all live there, keyed by graph,
shapes, dtypes, torch and Triton versions and GPU. A later process that compiles the same
graphs loads them instead of compiling; a folder shared between runs, users or machines of
the same setup shares that.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""Where inductor keeps its on-disk caches; read by torch at each lookup, so setting it
before the first compile of the process is enough."""


def default_compile_cache() -> Path:
    """``$TORCHINDUCTOR_CACHE_DIR`` when the user set it, else ``~/.cache/dflash/compile``
    (``$XDG_CACHE_HOME`` honoured): a folder that outlives the run, unlike torch's temp default."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash" / "compile"


def use_compile_cache(folder: str | None) -> Path:
    """Keep torch.compile's persistent caches of this process in ``folder`` (None:
    ``default_compile_cache``); call it before the process's first compile."""
    path = (Path(folder).expanduser() if folder else default_compile_cache()).resolve()
    if any(c.isspace() for c in str(path)):
        raise ValueError(f"compile cache folder {str(path)!r} has a space in its path: inductor's C++ build "
                         "commands split paths at spaces; choose another folder (--compile-cache)")
    path.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_DIR_ENV] = str(path)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    off = [name for name, on in (("inductor's FX graph cache (TORCHINDUCTOR_FX_GRAPH_CACHE)",
                                  inductor_config.fx_graph_cache),
                                 ("the AOTAutograd cache (TORCHINDUCTOR_AUTOGRAD_CACHE)",
                                  functorch_config.enable_autograd_cache)) if not on]
    if off:
        log.warning("%s disabled: compiled graphs will not be reused across runs", " and ".join(off))
    return path


def cache_counts() -> dict[str, int]:
    """On-disk compile cache lookups of this process so far: hits, misses, and bypasses
    (graphs the cache cannot hold, which compile again in every run)."""
    from torch._dynamo.utils import counters

    fx, aot = counters["inductor"], counters["aot_autograd"]
    return {"fx_graph_hit": int(fx["fxgraph_cache_hit"]), "fx_graph_miss": int(fx["fxgraph_cache_miss"]),
            "fx_graph_bypass": int(fx["fxgraph_cache_bypass"]),
            "aot_autograd_hit": int(aot["autograd_cache_hit"]), "aot_autograd_miss": int(aot["autograd_cache_miss"]),
            "aot_autograd_bypass": int(aot["autograd_cache_bypass"])}
