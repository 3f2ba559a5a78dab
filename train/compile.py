"""Training's one compile path: a warm-up of one real step per shape, then ``fail_on_recompile`` makes
any recompile an error naming its guard. Compiled graphs persist in one folder across runs."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch._dynamo.config as dynamo_config
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch._dynamo.utils import counters

from . import attention
from .config import RuntimeConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"  # inductor's FX graph, AOTAutograd and autotuning caches


@dataclass
class CompileChoice:
    """What the runtime config resolves to on this device."""

    attention: str  # 'flex' (BlockMask + flex_attention) or 'dense' (bool mask + SDPA)
    compile_model: bool  # the drafter module goes through torch.compile
    backend: str  # torch.compile backend
    eager_flex: bool  # flex_attention runs uncompiled (only when asked for by name)


def resolve(runtime: RuntimeConfig, device: torch.device) -> CompileChoice:
    """The checked choice of ``attention`` / ``compile`` for ``device`` (uncompiled flex only by name)."""
    cuda = device.type == "cuda"
    kind = ("flex" if cuda else "dense") if runtime.attention == "auto" else runtime.attention
    if eager_flex := kind == "flex-eager":
        kind = "flex"
        log.warning("attention flex-eager: flex_attention runs UNCOMPILED and materialises the full score matrix")
    elif kind == "flex" and not cuda:
        raise ValueError("attention 'flex' cannot train on the CPU (flex_attention has no CPU backward); "
                         "use --attention dense (the same mask function through SDPA)")
    compile_disabled = os.environ.get("TORCHDYNAMO_DISABLE", "") not in ("", "0") or dynamo_config.disable
    if kind == "flex" and not eager_flex and compile_disabled:
        raise RuntimeError("torch.compile is disabled (TORCHDYNAMO_DISABLE?), so flex_attention would run "
                           "uncompiled on CUDA; enable compile, use --attention dense, or ask for "
                           "--attention flex-eager by name")
    attention.allow_uncompiled_flex(eager_flex)
    compile_model = {"auto": cuda, "on": True, "off": False}[runtime.compile]
    return CompileChoice(kind, compile_model, runtime.compile_backend, eager_flex)


def compile_count() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return int(counters["stats"]["unique_graphs"])


def compile_model(model: torch.nn.Module, choice: CompileChoice, graphs_needed: int) -> torch.nn.Module:
    """``torch.compile`` the drafter (static shapes) when the choice says so; else return it."""
    if not choice.compile_model:
        return model
    # a graph per (bucket, grad mode) below the limit, whose fall-back is silent eager
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, graphs_needed)
    return torch.compile(model, backend=choice.backend, dynamic=False)


def thaw() -> None:
    torch.compiler.set_stance("default")


def compile_then_freeze(run: Callable[[], T]) -> tuple[T, int, dict[str, int], float]:
    """(``run()``, graphs it compiled, its ``cache_counts``, seconds), compiling allowed inside it (a warm-up)
    and frozen again after."""
    start, graphs, cached = time.perf_counter(), compile_count(), cache_counts()
    thaw()
    try:
        result = run()
    finally:
        torch.compiler.set_stance("fail_on_recompile")
    use = {k: v - cached[k] for k, v in cache_counts().items()}
    return result, compile_count() - graphs, use, time.perf_counter() - start


def default_compile_cache() -> Path:
    """``$TORCHINDUCTOR_CACHE_DIR``, else ``~/.cache/dflash/compile`` (honouring ``$XDG_CACHE_HOME``)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash" / "compile"


def use_compile_cache(folder: str | None) -> Path:
    """Keep torch.compile's persistent caches in ``folder`` (None: the default); before any compile."""
    path = (Path(folder).expanduser() if folder else default_compile_cache()).resolve()
    if any(c.isspace() for c in str(path)):
        raise ValueError(f"compile cache folder {str(path)!r} has a space in its path: inductor's C++ build "
                         "commands split paths at spaces; choose another folder (--compile-cache)")
    path.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_DIR_ENV] = str(path)
    if not (inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache):
        log.warning("inductor's FX graph cache or the AOTAutograd cache is disabled (TORCHINDUCTOR_FX_GRAPH_CACHE, "
                    "TORCHINDUCTOR_AUTOGRAD_CACHE): compiled graphs will not be reused across runs")
    return path


def cache_counts() -> dict[str, int]:
    """On-disk compile cache lookups of this process so far: hits, misses and bypasses."""
    fx, aot = counters["inductor"], counters["aot_autograd"]
    return {f"{name}_{kind}": int(group[f"{key}_{kind}"]) for name, group, key in
            (("fx_graph", fx, "fxgraph_cache"), ("aot_autograd", aot, "autograd_cache"))
            for kind in ("hit", "miss", "bypass")}
