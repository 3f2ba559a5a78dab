"""``dflash-extract``: stage one from the command line (one flag per ExtractConfig field)."""

from __future__ import annotations

import json
import logging
import sys

import click

from dflash.shared.cli_options import CONTEXT_SETTINGS, build, options, validated

from .config import ExtractConfig


@click.command(context_settings=CONTEXT_SETTINGS)
@options(ExtractConfig)
def main(**kw) -> None:
    """Run the target over a chat dataset and write the DFlash hidden-state cache.

    Rerunning the same command resumes every shard at its last commit; on a complete
    cache it is a no-op. Alone it uses one device; under torchrun, one process per GPU
    (torchrun --nproc-per-node N -m dflash.extract.cli ...), rank 0 printing the summary.
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    cfg = validated(build(ExtractConfig, kw))
    if cfg.plan:
        _plan(cfg)
        return
    from .runner import ExtractFailed, format_summary, run

    summary_json = cfg.summary_json
    try:
        summary = run(cfg)
    except ExtractFailed as e:
        click.echo(f"dflash-extract: error: {e}", err=True)
        sys.exit(1)
    if summary is None:  # not rank 0
        return
    if summary.get("noop"):
        click.echo(f"{cfg.out}: already complete, nothing to do")
    click.echo(format_summary(summary))
    if summary_json:
        with open(summary_json, "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
            f.write("\n")


def _plan(cfg: ExtractConfig) -> None:
    """``--plan``: the report (or ``--json``) on stdout, also written to ``--summary-json`` where given."""
    from .runner import ExtractFailed
    from .size_plan import format_plan, plan_run

    try:
        plan = plan_run(cfg)
    except ExtractFailed as e:
        click.echo(f"dflash-extract: error: {e}", err=True)
        sys.exit(1)
    doc = plan.as_dict()
    click.echo(json.dumps(doc, indent=2) if cfg.json else format_plan(plan, cfg))
    if cfg.summary_json:
        with open(cfg.summary_json, "w") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
            f.write("\n")


if __name__ == "__main__":
    main()
