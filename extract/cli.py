"""``dflash-extract``: stage one from the command line (one flag per ExtractConfig field, of the same name)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from dflash.shared.cli import CommaList, Command, JsonObject, Maybe, ModelPath, validated
from dflash.shared.compression import HIDDEN_CODECS, SCALE_DTYPES, TOPK_DTYPES

from .config import BAD_ROW_POLICIES, DTYPES, TRUNCATION_POLICIES, ExtractConfig


@click.command(cls=Command)
@click.option("--data", required=True, help="Chat dataset: .jsonl/.json/.parquet file, folder or `datasets` name.")
@click.option("--model", type=ModelPath(), required=True, help="Target HF causal LM: a local folder or a hub name in "
              "the local cache.")
@click.option("--out", required=True, help="Cache root: a local path or a URL zarr/fsspec can write; rerun to resume.")
@click.option("--tokenizer", type=Maybe(ModelPath(needs=None)), help="Tokenizer folder or name; default: the model's.")
@click.option("--split", type=Maybe(str), help="Dataset split of `datasets` sources; default: 'train'.")
@click.option("--revision", type=Maybe(str), help="Model revision for hub names (recorded in the fingerprint).")
@click.option("--chat-template", type=Maybe(click.Path(exists=True, dir_okay=False)), help="Jinja file that replaces "
              "the tokenizer's chat template (its text is fingerprinted, its path recorded).")
@click.option("--layers", type=Maybe(CommaList(int)), help="Target layer ids to store, e.g. 1,9,17 (id i = HF "
              "hidden_states[i + 1]), ascending, below L-1; default: 5 spread over 1..L-3.")
@click.option("--topk", default=64, help="Target log-probs stored per position (the top-k of log_softmax).")
@click.option("--max-length", default=3072, help="Longest sample in tokens; longer ones are handled by --truncation.")
@click.option("--truncation", type=click.Choice(TRUNCATION_POLICIES), default="right", help="Over-long samples: "
              "'right' keeps the first max_length tokens, 'skip' drops them, 'error' stops.")
@click.option("--min-length", default=2, help="Shortest sample kept, in tokens: one anchor plus one token to predict "
              "is one usable block.")
@click.option("--template-kwargs", type=JsonObject(), default="{}", help="JSON object of variables passed to the chat "
              'template with every row, e.g. \'{"enable_thinking": false}\'.')
@click.option("--end-of-turn", type=Maybe(str), help="Token that ends an assistant turn (one vocabulary entry); "
              "default: found from the template.")
@click.option("--on-bad-row", type=click.Choice(BAD_ROW_POLICIES), default="error", help="Malformed rows: 'error' "
              "stops naming file and row, 'skip' drops them and counts the reason.")
@click.option("--dtype", type=click.Choice(DTYPES), default="bfloat16", help="Compute dtype of the target; hidden "
              "states are stored as bf16 bits, or as --hidden-codec encodes them.")
@click.option("--chunk-tokens", default=256, help="Tokens per Zarr chunk of the hidden states (the small arrays are "
              "chunked coarsely, see shared/cache.py).")
@click.option("--compression-level", default=1, help="zstd level of the stored chunks: 1, 3, 5, ..., 15 (blosc runs "
              "zstd at odd levels only).")
@click.option("--hidden-codec", type=click.Choice(HIDDEN_CODECS), default="bf16", help="How hidden states are stored: "
              "'bf16' lossless, or lossy 'fp8' (e4m3, a scale per token and layer), 'int8' or 'int4' (a scale per "
              "--hidden-group-size channels); decoded to bf16 when read.")
@click.option("--hidden-group-size", default=128, help="Channels sharing one scale under --hidden-codec int8/int4 "
              "(must divide the hidden size; even for int4).")
@click.option("--hidden-scale-dtype", type=click.Choice(SCALE_DTYPES), default="float16", help="dtype of the lossy "
              "codecs' scales; float32 where activations exceed what float16 scales hold.")
@click.option("--topk-dtype", type=click.Choice(TOPK_DTYPES), default="float32", help="Precision of the stored top-k "
              "log-probs (read back as float32).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", help="'cuda' (cuda:LOCAL_RANK under "
              "torchrun, one process per GPU; cuda:0 alone) or 'cpu'.")
@click.option("--shards", type=Maybe(int), help="Shards of the cache: rank r of torchrun's W processes writes shards "
              "r, r + W, ...; default: W (1 alone).")
@click.option("--batch-tokens", default=16384, help="Token budget of one forward batch, counting padding (batch size "
              "x longest sample).")
@click.option("--lm-head-chunk", default=1024, help="Tokens per LM-head chunk: bounds the logits to chunk x vocab.")
@click.option("--attn-implementation", type=Maybe(str), default="sdpa", help="Attention kernel passed to "
              "from_pretrained ('sdpa', 'eager', 'flash_attention_2'; none = HF default).")
@click.option("--commit-seconds", default=30.0, help="Seconds between commits of a shard (a crash loses at most this "
              "much work); 0 = every batch.")
@click.option("--queue-depth", default=2, help="Batches in flight between the forward loop and the writer thread "
              "(bounds host memory).")
@click.option("--cpu-threads", type=Maybe(int), help="torch threads of each CPU process; default: the machine's "
              "cores divided by torchrun's LOCAL_WORLD_SIZE.")
@click.option("--summary-json", type=Maybe(str), help="Also write the closing summary as JSON to this path.")
@click.option("--progress/--no-progress", default=True, help="Show the progress bar (stderr).")
@click.option("--wait-for-lock/--no-wait-for-lock", default=False, help="A shard whose lock another run holds: wait "
              "until it is released, instead of stopping with its holder named.")
@click.option("--plan/--no-plan", default=False, help="Only plan: tokenise and count the rows as the run would, "
              "estimate its bytes on disk and GPU-hours, and exit (no target forward, no weights loaded, nothing "
              "written).")
@click.option("--json/--no-json", default=False, help="With --plan: print the plan as JSON, not the report.")
@click.option("--ignore-free-space/--no-ignore-free-space", default=False, help="Start even where the output's free "
              "space is below the estimate of what the run still has to write.")
def main(**kw) -> None:
    """Run the target over a chat dataset and write the DFlash hidden-state cache.

    Rerunning the same command resumes every shard at its last commit; on a complete
    cache it is a no-op. Alone it uses one device; under torchrun, one process per GPU
    (torchrun --nproc-per-node N -m dflash.extract.cli ...), rank 0 printing the summary.
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    cfg = validated(ExtractConfig(**kw))
    from .plan import format_plan, plan_run
    from .runner import ExtractFailed, format_summary, run

    try:
        if cfg.plan:  # the report (or --json) on stdout; nothing loaded or written
            doc = plan_run(cfg)
            click.echo(json.dumps(doc, indent=2) if cfg.json else format_plan(doc, cfg))
        else:
            doc = run(cfg)
            if doc is None:  # not rank 0: rank 0 prints the summary
                return
            if doc.get("noop"):
                click.echo(f"{cfg.out}: already complete, nothing to do")
            click.echo(format_summary(doc))
    except ExtractFailed as e:
        click.echo(f"dflash-extract: error: {e}", err=True)
        sys.exit(1)
    if cfg.summary_json:  # the plan or the closing summary
        Path(cfg.summary_json).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    if not cfg.plan and doc["complete"] and not doc["samples"]:  # training would refuse it: say so now
        skipped = sum(doc["skipped"].values())
        said = f"all {skipped} rows skipped (reasons above; --on-bad-row error names the first)" if skipped else \
            "it has no rows"
        click.echo(f"dflash-extract: error: no samples from {cfg.data}: {said}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
