"""Checkpoints, RUN/checkpoints/step_000123/: model.safetensors (export names), optimizer.pt,
scheduler.pt, rng_rank{r}.pt, state.json; written as ``.partial`` and renamed, for a bitwise resume."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from .model import DFlashDrafter, DrafterConfig

log = logging.getLogger(__name__)


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first."""
    found = [(int(m.group(1)), p) for p in (Path(run_dir) / "checkpoints").glob("step_*")
             if (m := re.fullmatch(r"step_(\d+)", p.name)) and (p / "state.json").is_file()]
    return [p for _, p in sorted(found)]


def resolve(run_dir: str | os.PathLike, which: str | None = "latest") -> Path | None:
    """``latest`` -> newest complete checkpoint of the run (or None); a path -> that folder."""
    if which is None:
        return None
    if which == "latest":
        return next(reversed(list_checkpoints(run_dir)), None)
    path = Path(which)
    if not path.is_absolute() and not path.exists():
        path = Path(run_dir) / "checkpoints" / which
    if not (path / "state.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no state.json)")
    return path


def _is_fsdp(model: torch.nn.Module) -> bool:
    return any(type(m).__name__.startswith("FSDP") for m in model.modules())


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(run_dir: str | os.PathLike, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scheduler, info: dict[str, Any], keep: int = 0) -> Path:
    """Write checkpoint ``step`` (every rank calls this; rank 0 writes the shared files)."""
    rank, world = _rank_world()
    final = Path(run_dir) / "checkpoints" / f"step_{step:06d}"
    partial = final.with_name(final.name + ".partial")
    if _is_fsdp(model):  # full, unsharded CPU state dicts: a collective, every rank takes part
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        weights, optim = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                   cpu_offload=True))
    else:
        weights, optim = {k: v.detach().cpu() for k, v in model.state_dict().items()}, optimizer.state_dict()
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(partial / "model.safetensors"))
        torch.save(optim, partial / "optimizer.pt")
        torch.save(scheduler.state_dict(), partial / "scheduler.pt")
    _barrier()
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, partial / f"rng_rank{rank}.pt")
    _barrier()
    if rank == 0:
        state = {"step": step, "world_size": world, "saved_at": time.time(), **info}
        (partial / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True, default=str))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        if keep > 0:
            for old in list_checkpoints(run_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
        log.info("saved checkpoint %s", final)
    _barrier()
    return final


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(path) / "state.json").read_text())


def load_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def load_drafter(path: str | os.PathLike) -> tuple[DFlashDrafter, dict[str, Any]]:
    """The drafter of checkpoint ``path`` (float32 master weights) and its state.json."""
    state = read_state(path)
    try:
        config = DrafterConfig.from_dict(state["drafter_config"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"{path}/state.json holds no usable drafter_config ({e!r})") from e
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(load_weights(path), strict=True)
    return drafter, state


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler
         ) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and this rank's RNG; return state.json."""
    path, (rank, world) = Path(path), _rank_world()
    state, weights = read_state(path), load_weights(path)
    optim = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim,
                       options=StateDictOptions(full_state_dict=True))
    else:
        model.load_state_dict(weights, strict=True)
        optimizer.load_state_dict(optim)
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", map_location="cpu", weights_only=True))
    rng_file = path / f"rng_rank{rank}.pt"
    if state.get("world_size") == world and rng_file.exists():
        rng = torch.load(rng_file, map_location="cpu", weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    else:
        log.warning("resuming on %d ranks from a %s-rank checkpoint: RNG states not restored",
                    world, state.get("world_size"))
    return state
