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
    cache it is a no-op. Under torchrun (one process per node) each node runs its own
    workers and shards.
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from .launch import ExtractFailed, Workers, node_layout, node_tasks

    cfg = validated(build(ExtractConfig, kw))
    summary_json = cfg.summary_json
    try:
        # the workers start their imports and planning now, before this process imports torch
        workers = Workers(node_tasks(cfg, node_layout()))
        from .runner import format_summary, run

        summary = run(cfg, workers)
    except ExtractFailed as e:
        click.echo(f"dflash-extract: error: {e}", err=True)
        sys.exit(1)
    if summary.get("noop"):
        click.echo(f"{cfg.out}: already complete, nothing to do")
    click.echo(format_summary(summary))
    if summary_json:
        with open(summary_json, "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
            f.write("\n")


if __name__ == "__main__":
    main()
