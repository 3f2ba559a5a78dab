"""``dflash-train``: train a drafter from a cache, export a checkpoint.

    dflash-train run --cache C --out RUN [--target T] [--preset dflash|tiny] [--FIELD VALUE ...]
    dflash-train --cache C --out RUN ...        (same as ``run``)
    dflash-train export RUN --out DIR [--checkpoint latest|step_000100|PATH] [--dtype bfloat16] [--target T]

``--target`` defaults to the target the cache records (``run``) or the run trained for (``export``).

Every field of ``TrainConfig`` is a flag (``--max-anchors 64``, ``--lr 1e-3``,
``--context-buckets 1024,2048,3072``, ``--target-layer-ids none``). Multi-GPU runs go
through torchrun (see ``make train``); one process needs nothing.
"""

from __future__ import annotations

import logging
import sys
import typing
from pathlib import Path

import click

from dflash.shared.cli_options import (CONTEXT_SETTINGS, given, options, pick, reading, usable_device,
                                       validated)

from . import config as config_mod
from .config import ExportOptions, RunOptions, TrainConfig


def _setup_logging() -> None:
    import os

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cpu_preset_warning(preset: str, device: str) -> str | None:
    """The warning for a run of the full-size recipe on the CPU (minutes per step there), else None."""
    import torch

    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if preset != "dflash" or not on_cpu:
        return None
    return ("the dflash preset (a drafter as wide as the target, 3072-token contexts, 512 blocks per sequence) "
            "takes minutes per step on the CPU; for a CPU run use --preset tiny")


@click.group(context_settings=CONTEXT_SETTINGS)
def cli():
    """Train DFlash drafters from a hidden-state cache."""


@cli.command()
@options(RunOptions, TrainConfig)
@click.pass_context
def run(ctx: click.Context, **values):
    """Train (or resume, from RUN/checkpoints/latest) a drafter."""
    opts = RunOptions(**pick(RunOptions, values))
    cfg = config_mod.PRESETS[opts.preset]()
    cfg.override(**pick(TrainConfig, given(ctx, values)))
    if opts.print_config:
        click.echo(cfg.to_json())
        return
    for required in ("cache", "out"):
        if not getattr(cfg, required):
            raise click.UsageError(f"--{required} is required")
    validated(cfg)
    usable_device(cfg.runtime.device)
    _setup_logging()
    warning = cpu_preset_warning(opts.preset, cfg.runtime.device)
    if warning:
        logging.getLogger("dflash.train").warning(warning)
    from .loop import train

    summary = train(cfg)  # a bad cache, target or flag value is one line (cli_options), not a traceback
    if summary["eval"] is not None:
        click.echo(f"done: step {summary['step']}/{summary['total_steps']}, eval loss {summary['eval']['loss']:.4f}, "
                   f"tau {summary['eval']['tau']:.3f}", err=True)


@cli.command()
@options(ExportOptions)
def export(**values):
    """Export a checkpoint of RUN as a DFlashDraftModel folder (SGLang / vLLM format),
    checked against its target, and print the commands that serve it."""
    import json
    import os

    import torch

    from . import checkpoint
    from .export import check_against_target, export_drafter, serve_commands
    from .model import DFlashDrafter, DrafterConfig
    from .target import load_target_meta, looks_like_path

    opts = validated(ExportOptions(**values))
    run_dir, target = opts.run, opts.target
    with reading("--checkpoint"):
        path = checkpoint.resolve(run_dir, opts.checkpoint)
    if path is None:
        raise click.ClickException(f"{run_dir} has no complete checkpoint")
    state = checkpoint.read_state(path)
    try:
        dcfg = DrafterConfig.from_dict(state["drafter_config"])
    except ValueError as e:
        raise click.ClickException(f"{path}: {e}") from e
    run_config = Path(run_dir) / "config.json"
    target = target or (state.get("config") or {}).get("target") or \
        (json.loads(run_config.read_text()).get("target") if run_config.exists() else None)
    if not target:
        raise click.ClickException(f"{run_dir} records no target; pass --target")
    if looks_like_path(target) and not os.path.exists(target):
        raise click.ClickException(f"the run's target {target} no longer exists; pass --target with its folder")
    try:
        check_against_target(dcfg, *load_target_meta(target))
    except (OSError, ValueError) as e:
        raise click.ClickException(f"{run_dir} cannot be exported for {target} (--target names another place "
                                   f"of the same target): {e}") from e
    drafter = DFlashDrafter(dcfg)
    drafter.load_state_dict(checkpoint.load_weights(path), strict=True)
    out = export_drafter(drafter, dcfg, opts.out, dtype=getattr(torch, opts.dtype))
    click.echo(f"exported {path} (step {state['step']}) -> {out}, checked against {target}")
    commands = serve_commands(out, target, dcfg.block_size)
    click.echo(f"serve with SGLang:\n  {commands['sglang']}\nserve with vLLM:\n  {commands['vllm']}")


def main(argv: typing.Sequence[str] | None = None) -> None:
    """Entry point; ``dflash-train --cache ...`` means ``dflash-train run --cache ...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0].startswith("--") and args[0] not in ("--help", "-h"):
        args.insert(0, "run")
    cli.main(args=args, prog_name="dflash-train", standalone_mode=argv is None)


if __name__ == "__main__":
    main()
