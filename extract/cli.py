"""``dflash-extract``: stage one from the command line (flags map onto ExtractConfig)."""

from __future__ import annotations

import json
import logging
import sys

import click

from .config import BAD_ROW_POLICIES, DTYPES, TRUNCATION_POLICIES, ExtractConfig


def _int_list(ctx, param, value):
    if value is None or value == "":
        return None
    try:
        return [int(x) for x in str(value).split(",") if x.strip() != ""]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


def _json_object(ctx, param, value):
    if value is None:
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not valid JSON ({e}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter(f"expected a JSON object such as '{{\"enable_thinking\": false}}', got {value!r}")
    return parsed


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--data", required=True, help="Chat dataset: .jsonl/.json/.parquet file, folder, or datasets name.")
@click.option("--model", required=True, help="Target HF causal LM (local folder or cached hub name).")
@click.option("--out", required=True, help="Cache root (local path or zarr/fsspec URL); rerun to resume.")
@click.option("--tokenizer", default=None, help="Tokenizer, if not the model's.")
@click.option("--split", default=None, help="Dataset split (default: train).")
@click.option("--revision", default=None, help="Model revision.")
@click.option("--chat-template", default=None, type=click.Path(exists=True, dir_okay=False, readable=True),
              help="Jinja file that replaces the tokenizer's chat template (fingerprinted).")
@click.option("--template-kwargs", callback=_json_object, default=None,
              help='JSON object of variables for the chat template, e.g. \'{"enable_thinking": false}\' (fingerprinted).')
@click.option("--end-of-turn", default=None,
              help="Token that ends an assistant turn, e.g. '<end_of_turn>' (default: found from the template).")
@click.option("--layers", callback=_int_list, default=None,
              help="Layer ids to store, e.g. 1,9,17 (id i = HF hidden_states[i+1]); default: 5 spread over 1..L-3.")
@click.option("--topk", default=64, type=click.IntRange(1), help="Top-k target log-probs per position.")
@click.option("--max-length", default=3072, type=click.IntRange(1), help="Longest sample in tokens.")
@click.option("--truncation", type=click.Choice(TRUNCATION_POLICIES), default="right",
              help="Over-long samples: keep the first max-length tokens, skip them, or stop.")
@click.option("--min-length", default=2, type=click.IntRange(1), help="Shorter samples are skipped (counted).")
@click.option("--on-bad-row", type=click.Choice(BAD_ROW_POLICIES), default="error",
              help="Malformed rows: stop naming file and row, or skip and count them.")
@click.option("--chunk-tokens", default=256, type=click.IntRange(1), help="Tokens per Zarr chunk.")
@click.option("--compression-level", default=1, type=click.IntRange(1, 19), help="zstd level of the chunks.")
@click.option("--dtype", type=click.Choice(DTYPES), default="bfloat16", help="Compute dtype of the target.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", help="Run on GPUs or CPU processes.")
@click.option("--gpus", callback=_int_list, default="0,1,2,3,4", help="CUDA devices of this node.")
@click.option("--workers-per-gpu", default=1, type=click.IntRange(1),
              help="Worker processes per GPU, each with its own model copy, shard and writer.")
@click.option("--workers", default=1, type=click.IntRange(1), help="CPU worker processes (with --device cpu).")
@click.option("--batch-tokens", default=16384, type=click.IntRange(1), help="Padded tokens per forward batch.")
@click.option("--lm-head-chunk", default=1024, type=click.IntRange(1), help="Tokens per LM-head chunk.")
@click.option("--attn-implementation", default="sdpa", help="Attention kernel for from_pretrained ('' = HF default).")
@click.option("--commit-seconds", default=30.0, type=click.FloatRange(0), help="Seconds between shard commits.")
@click.option("--queue-depth", default=2, type=click.IntRange(1), help="Batches in flight to the writer thread.")
@click.option("--writer-processes", default=None, type=click.IntRange(0),
              help="Processes per worker that compress and write the cache arrays (0: the writer thread); "
                   "default 2 on CUDA, 0 on the CPU.")
@click.option("--cpu-threads", default=None, type=click.IntRange(1), help="torch threads per CPU worker.")
@click.option("--summary-json", default=None, type=click.Path(dir_okay=False), help="Also write the summary here.")
@click.option("--progress/--no-progress", default=True, help="Show the progress bar.")
@click.option("--wait-for-lock", is_flag=True, default=False,
              help="Wait for shards another live run is writing, instead of stopping with its holder named.")
@click.option("--batch-delay-s", default=0.0, type=float, hidden=True)
def main(**kw) -> None:
    """Run the target over a chat dataset and write the DFlash hidden-state cache.

    Rerunning the same command resumes every shard at its last commit; on a complete
    cache it is a no-op. Under torchrun (one process per node) each node runs its own
    workers and shards.
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from .runner import ExtractFailed, format_summary, run

    summary_json = kw.pop("summary_json")
    if kw["attn_implementation"] == "":
        kw["attn_implementation"] = None
    if kw["gpus"] is None:
        kw["gpus"] = []
    cfg = ExtractConfig(**kw, summary_json=summary_json)
    try:
        summary = run(cfg)
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
