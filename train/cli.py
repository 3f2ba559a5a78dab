"""``dflash-train [run] --cache C --out RUN [--FIELD VALUE ...]`` trains a drafter (one flag per
``TrainConfig`` field; torchrun for several GPUs); ``dflash-train export RUN --out DIR`` exports it."""

from __future__ import annotations

import logging
import os
import sys
import typing

import click
from click.core import ParameterSource

from dflash.shared.cli import CommaList, Group, Maybe, ModelPath, reading, usable_device, validated

from . import config as config_mod


def cpu_preset_warning(preset: str, device: str) -> str | None:
    """The warning for a run of the full-size recipe on the CPU (minutes per step there), else None."""
    import torch

    if preset != "dflash" or not (device == "cpu" or (device == "auto" and not torch.cuda.is_available())):
        return None
    return ("the dflash preset (a drafter as wide as the target, 3072-token contexts, 512 blocks per sequence) "
            "takes minutes per step on the CPU; for a CPU run use --preset tiny")


@click.group(cls=Group)
def cli():
    """Train DFlash drafters from a hidden-state cache."""


@cli.command()
@click.option("--preset", type=click.Choice(list(config_mod.PRESETS)), default="dflash", help="Starting point (the "
              "defaults shown are the dflash preset's, the recipe for 8B-class targets; small: a small target on "
              "one GPU (block 8, 3 layers, loss decay gamma 2, shorter contexts, 12 loader workers); tiny: CPU "
              "tests); flags override its fields.")
@click.option("--print-config/--no-print-config", default=False, help="Print the resolved config, checked, as JSON "
              "and exit.")
@click.option("--cache", help="Path of the hidden-state cache (Zarr) written by dflash-extract.")
@click.option("--target", type=ModelPath(), help="Target model folder or name (config, tokenizer, embedding, LM "
              "head); default: the one the cache records.")
@click.option("--out", help="Run folder: checkpoints/, metrics.jsonl, config.json, tb/.")
@click.option("--num-draft-layers", default=5, help="Decoder layers of the drafter (each the size of a target layer).")
@click.option("--block-size", default=16, help="B: tokens per draft block (anchor + B-1 masks).")
@click.option("--target-layer-ids", type=Maybe(CommaList(int)), help="Target layers fed to the drafter (ascending, "
              "below L-1); None = the layers the cache stores.")
@click.option("--mask-token-id", type=Maybe(int), help="Embedding row of the MASK token, absent from the cache's "
              "input_ids; None = the tokenizer's <|MASK|>, else the first padded row, else the first special token "
              "(not eos/bos/pad or the template's) the cache never holds.")
@click.option("--gamma", type=Maybe(float), help="Slot k weighs exp(-(k-1)/gamma); None: 7/5/4 at B=16/10/8.")
@click.option("--loss", type=click.Choice(["ce", "kd", "mix"]), default="kd", help="CE on the labels, KL from the "
              "target's stored top-k (+ tail bucket), or both.")
@click.option("--kd-weight", default=0.5, help="Weight of the KL term in mix: (1 - kd_weight) * CE + kd_weight * KL.")
@click.option("--init-from-target-layers", type=Maybe(CommaList(int)), help="Drafter layer i starts as a copy of "
              "target layer ids[i] (and its final norm as the target's); None = random.")
@click.option("--context-buckets", type=CommaList(int), default="1024,2048,3072", help="Context lengths a batch is "
              "padded to (one compiled graph each); the last is max length.")
@click.option("--max-anchors", default=512, help="N: anchor blocks per sequence (fewer candidates -> invalid blocks).")
@click.option("--batch-size", default=16, help="Sequences per optimizer step (all ranks and accumulation steps).")
@click.option("--micro-batch-size", default=1, help="Sequences per forward on one rank (accumulation fills the batch).")
@click.option("--eval-samples", type=Maybe(int), help="Held-out samples (the dataset's last rows) for eval loss and "
              "acceptance; None = min(64, a tenth of the cache), at least 1.")
@click.option("--train-samples", type=Maybe(int), help="Train on the dataset's first N rows that are not held out "
              "(None = all): tau against data size from one cache.")
@click.option("--num-workers", default=2, help="DataLoader worker processes per rank (0 = load in the main process).")
@click.option("--hidden-decode", type=click.Choice(["auto", "loader", "device"]), default="auto",
              help="Where a lossy cache's hidden states are decoded: in the loader workers, or on the training device "
              "after the copy (fewer bytes to copy, no CPU decode); 'auto' = device on CUDA. Same values either way.")
@click.option("--preload", type=click.Choice(["auto", "on", "off"]), default="auto",
              help="Read the samples once into the training device's memory and cut batches there (no loader workers, "
              "no copy per step); auto: on CUDA where they fit in 90% of what the compiled step's peak leaves. Same "
              "batches either way.")
@click.option("--lr", default=6e-4, help="Peak learning rate.")
@click.option("--min-lr-ratio", default=0.0, help="Learning rate at the end of the cosine, as a fraction of lr.")
@click.option("--warmup-ratio", default=0.04, help="Fraction of all steps spent in linear warm-up.")
@click.option("--weight-decay", default=0.0, help="AdamW decoupled weight decay.")
@click.option("--beta1", default=0.9, help="AdamW beta1.")
@click.option("--beta2", default=0.95, help="AdamW beta2.")
@click.option("--grad-clip", default=1.0, help="Max global gradient norm (0 = no clipping).")
@click.option("--epochs", default=6.0, help="Passes over the training samples (fractional allowed).")
@click.option("--max-steps", type=Maybe(int), help="Optimizer steps in total; overrides epochs.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              help="auto: cuda:LOCAL_RANK if CUDA is there.")
@click.option("--attention", type=click.Choice(["auto", "flex", "dense", "flex-eager"]), default="auto",
              help="auto: flex on CUDA, dense SDPA on CPU.")
@click.option("--compile", type=click.Choice(["auto", "on", "off"]), default="auto", help="torch.compile the drafter "
              "(auto: on CUDA only).")
@click.option("--compile-backend", default="inductor", help="torch.compile backend ('eager': guards without codegen).")
@click.option("--compile-cache", type=Maybe(str), help="Compiled graphs kept for runs of the same shapes (None: "
              "$TORCHINDUCTOR_CACHE_DIR or ~/.cache/dflash/compile).")
@click.option("--autocast", type=click.Choice(["auto", "bf16", "on", "off"]), default="auto",
              help="bf16 autocast around the forward (on = bf16; auto: on CUDA).")
@click.option("--parallel", type=click.Choice(["ddp", "fsdp"]), default="ddp", help="DDP, or FSDP2 for big drafters.")
@click.option("--ce-chunk-size", default=4096, help="Rows per chunk of the LM-head loss (bounds the logits memory).")
@click.option("--seed", default=0, help="Seeds the drafter init, data order and anchor draws.")
@click.option("--log-every", default=10, help="Steps between log lines (the only steps that call .item()).")
@click.option("--eval-every", default=500, help="Steps between held-out evaluations (and always at the last step).")
@click.option("--save-every", default=1000, help="Steps between checkpoints (and always at the last step).")
@click.option("--keep-checkpoints", default=3, help="Newest checkpoints kept (0 = keep all).")
@click.option("--resume", type=Maybe(str), default="latest", help="Checkpoint folder to resume from, 'latest' or None.")
@click.option("--stop-after", type=Maybe(int), help="Stop after this many steps, not as the last (simulates a kill).")
@click.option("--peak-tflops", default=790.0, help="Device peak for MFU (790: bf16 matmul measured on H200).")
@click.option("--tensorboard/--no-tensorboard", default=True, help="Also write TensorBoard events (if importable).")
@click.option("--progress/--no-progress", default=True, help="Show a tqdm progress bar on rank 0.")
@click.pass_context
def run(ctx: click.Context, preset: str, print_config: bool, **values):
    """Train (or resume, from RUN/checkpoints/latest) a drafter."""
    cfg = config_mod.PRESETS[preset]()
    cfg.override(**{k: v for k, v in values.items() if ctx.get_parameter_source(k) is ParameterSource.COMMANDLINE})
    validated(cfg)
    if print_config:
        click.echo(cfg.to_json())
        return
    for required in ("cache", "out"):
        if not getattr(cfg, required):
            raise click.UsageError(f"--{required} is required")
    usable_device(cfg.runtime.device)
    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if warning := cpu_preset_warning(preset, cfg.runtime.device):
        logging.getLogger("dflash.train").warning(warning)
    from .loop import train

    summary = train(cfg)  # a bad cache, target or flag value is one line (shared.cli.Command), not a traceback
    ev, step, total = summary["eval"], summary["step"], summary["total_steps"]
    click.echo((f"done: step {step}/{total}" if step == total else f"stopped at step {step}/{total} (rerun to go on)")
               + (f", eval loss {ev['loss']:.4f}, tau {ev['tau']:.3f}" if ev else ""), err=True)


@cli.command()
@click.argument("run_dir", metavar="RUN", type=click.Path(exists=True, file_okay=False))
@click.option("--out", required=True, help="Export folder (config.json + model.safetensors).")
@click.option("--checkpoint", default="latest", help="'latest', a step folder name (step_000100) or a checkpoint path.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16",
              help="dtype of the exported weights.")
@click.option("--target", type=Maybe(ModelPath()), help="Target folder or hub name the export is checked against and "
              "served with; default: the run's.")
def export(run_dir: str, out: str, checkpoint: str, dtype: str, target: str | None):
    """Export a checkpoint of RUN (the training run's folder) as a DFlashDraftModel folder (SGLang / vLLM
    format), checked against its target, and print the commands that serve it."""
    import torch

    from .checkpoint import load_drafter, resolve
    from .export import check_against_target, export_drafter, serve_commands
    from .target import load_target_meta, looks_like_path

    with reading("--checkpoint"):
        path = resolve(run_dir, checkpoint)
    if path is None:
        raise click.ClickException(f"{run_dir} has no complete checkpoint")
    drafter, state = load_drafter(path)
    dcfg = drafter.config
    if not (target := target or (state.get("config") or {}).get("target")):
        raise click.ClickException(f"{run_dir} records no target; pass --target")
    if looks_like_path(target) and not os.path.exists(target):
        raise click.ClickException(f"the run's target {target} no longer exists; pass --target with its folder")
    try:
        check_against_target(dcfg, *load_target_meta(target))
    except (OSError, ValueError) as e:
        raise click.ClickException(f"{run_dir} cannot be exported for {target} (--target names another place "
                                   f"of the same target): {e}") from e
    out = export_drafter(drafter, dcfg, out, dtype=getattr(torch, dtype))
    click.echo(f"exported {path} (step {state['step']}) -> {out}, checked against {target}")
    commands = serve_commands(out, target, dcfg.block_size)
    click.echo(f"serve with SGLang:\n  {commands['sglang']}\nserve with vLLM:\n  {commands['vllm']}")


def main(argv: typing.Sequence[str] | None = None) -> None:
    """Entry point; ``dflash-train --cache ...`` means ``dflash-train run --cache ...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0].startswith("--") and args[0] != "--help":
        args.insert(0, "run")
    cli.main(args=args, prog_name="dflash-train", standalone_mode=argv is None)


if __name__ == "__main__":
    main()
