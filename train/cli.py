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

import dataclasses
import logging
import sys
import typing
from pathlib import Path

import click

from . import config as config_mod

_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def _annotations() -> dict[str, str]:
    out = {}
    for kind in (config_mod.TrainConfig, config_mod.DrafterSpec, config_mod.DataConfig,
                 config_mod.OptimConfig, config_mod.RuntimeConfig):
        for f in dataclasses.fields(kind):
            if f.name not in config_mod.TrainConfig.SECTIONS:
                out[f.name] = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return out


def parse_value(annotation: str, text: str):
    """Flag text -> field value, by the field's annotation ('none' for optional fields)."""
    ann = annotation.replace(" ", "")
    optional = ann.endswith("|None")
    base = ann[: -len("|None")] if optional else ann
    if optional and text.lower() in ("none", "null", ""):
        return None
    if base.startswith("list["):
        inner = base[5:-1]
        return [parse_value(inner, t) for t in text.split(",") if t.strip()]
    if base == "int":
        return int(text)
    if base == "float":
        return float(text)
    if base == "bool":
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise click.BadParameter(f"expected true/false, got {text!r}")
    return text


def _field_options(fn):
    docs = config_mod.field_docs()
    for name, ann in reversed(list(_annotations().items())):
        fn = click.option(f"--{name.replace('_', '-')}", name, type=str, default=None,
                          help=f"{docs.get(name, '')} [{ann}]")(fn)
    return fn


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


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
def cli():
    """Train DFlash drafters from a hidden-state cache."""


@cli.command(context_settings={"max_content_width": 120})
@click.option("--preset", type=click.Choice(sorted(config_mod.PRESETS)), default="dflash", show_default=True,
              help="Starting point; flags override its fields.")
@click.option("--print-config", is_flag=True, help="Print the resolved config as JSON and exit.")
@_field_options
def run(preset, print_config, **fields):
    """Train (or resume, from RUN/checkpoints/latest) a drafter."""
    cfg = config_mod.PRESETS[preset]()
    ann = _annotations()
    cfg.override(**{k: parse_value(ann[k], v) for k, v in fields.items() if v is not None})
    if print_config:
        click.echo(cfg.to_json())
        return
    for required in ("cache", "out"):
        if not getattr(cfg, required):
            raise click.UsageError(f"--{required} is required")
    _setup_logging()
    warning = cpu_preset_warning(preset, cfg.runtime.device)
    if warning:
        logging.getLogger("dflash.train").warning(warning)
    from dflash.shared.cache import CacheError

    from .loop import train
    from .target import TargetNotFound

    try:
        summary = train(cfg)
    except (CacheError, TargetNotFound) as e:
        raise click.ClickException(str(e)) from e
    if summary["eval"] is not None:
        click.echo(f"done: step {summary['step']}/{summary['total_steps']}, eval loss {summary['eval']['loss']:.4f}, "
                   f"tau {summary['eval']['tau']:.3f}", err=True)


@cli.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Export folder.")
@click.option("--checkpoint", "which", default="latest", show_default=True,
              help="'latest', a step folder name (step_000100) or a checkpoint path.")
@click.option("--dtype", type=click.Choice(sorted(_DTYPES)), default="bfloat16", show_default=True,
              help="dtype of the exported weights.")
@click.option("--target", default=None,
              help="Target folder or hub name the export is checked against and served with; default: the run's.")
def export(run_dir, out_dir, which, dtype, target):
    """Export a checkpoint of RUN_DIR as a DFlashDraftModel folder (SGLang / vLLM format),
    checked against its target, and print the commands that serve it."""
    import json
    import os

    import torch

    from . import checkpoint
    from .export import check_against_target, export_drafter, serve_commands
    from .model import DFlashDrafter, DrafterConfig
    from .target import load_target_meta, looks_like_path

    path = checkpoint.resolve(run_dir, which)
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
    out = export_drafter(drafter, dcfg, out_dir, dtype=getattr(torch, dtype))
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
