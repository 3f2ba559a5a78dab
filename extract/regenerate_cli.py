"""Command line of regeneration (`dflash-regenerate`, `python -m dflash.extract.regenerate_cli`,
`make regenerate`): the in-process engine (`--model`) or a server (`--endpoint`)."""

from __future__ import annotations

import logging

import click

from dflash.shared.cli import Command, JsonObject, Maybe, model_folder_problem, take, usable_device, validated

from .regenerate_endpoint import EndpointDown
from .regenerate import GenerationSettings, RegenConfig, regenerate


@click.command(cls=Command)
@click.option("--data", required=True, help="Chat dataset (anything extract reads).")
@click.option("--model", type=Maybe(str), help="Target model: HF folder or hub name (in process); with --endpoint, "
              "the served model's name (default: the one the server lists).")
@click.option("--endpoint", type=Maybe(str), help="OpenAI-compatible server's base URL, e.g. http://HOST:8000/v1.")
@click.option("--out", required=True, help="Output folder (rerun to resume).")
@click.option("--split", default="train", help="Source dataset split.")
@click.option("--temperature", default=0.0, help="0 = greedy; above 0, sampling at this temperature.")
@click.option("--top-p", default=1.0, help="Nucleus mass when sampling.")
@click.option("--seed", default=0, help="Base seed; part i samples from seed (seed, i) (per-turn request seeds with "
              "--endpoint).")
@click.option("--max-new-tokens", default=1024, help="Tokens per assistant turn (max_tokens with --endpoint).")
@click.option("--max-prompt-tokens", type=Maybe(int), help="Cut a conversation before a turn whose prompt is longer.")
@click.option("--drop-truncated/--no-drop-truncated", default=False, help="Cut a conversation at a turn that hit "
              "max_new_tokens (else keep the turn and count it).")
@click.option("--template-kwargs", type=JsonObject(), default="{}", help="JSON for the chat template, e.g. "
              '\'{"enable_thinking": false}\' (chat_template_kwargs with --endpoint).')
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16",
              help="Target compute dtype (in process only).")
@click.option("--batch-size", type=Maybe(click.IntRange(min=1)), help="Prompts per generate() call (in process); "
              "default: 512 on a GPU, 16 on the CPU.")
@click.option("--concurrency", type=click.IntRange(min=1), default=32, help="Conversations in flight at once "
              "(--endpoint).")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, help="Seconds for one "
              "request (--endpoint).")
@click.option("--retries", type=click.IntRange(min=0), default=6, help="Retries of a failed request (connection "
              "error, timeout, 429, 5xx), backoff 1 s doubling (--endpoint).")
@click.option("--extra-body", type=JsonObject(), default="{}", help='JSON merged into every request, e.g. \'{"top_k": '
              "-1}' (--endpoint).")
@click.option("--api-key", type=Maybe(str), envvar="OPENAI_API_KEY", show_envvar=True, help="Bearer token "
              "(--endpoint).")
@click.option("--part-size", type=Maybe(click.IntRange(min=1)), help="Source rows per output part (the resume unit); "
              "default: 256 through --endpoint, 4096 in process.")
@click.option("--limit", type=Maybe(click.IntRange(min=1)), help="Use the first N source rows.")
@click.option("--device", default="cpu", help="cpu, cuda or cuda:N (in process only).")
@click.option("--static-cache/--no-static-cache", default=None, help="Static KV cache, decode step compiled into CUDA "
              "graphs (in process; default: on for cuda).")
@click.option("--on-bad-row", type=click.Choice(["skip", "error"]), default="skip", help="Source rows that do not "
              "normalise and requests the server rejects: skip and count them, or stop.")
@click.option("--overwrite/--no-overwrite", default=False, help="Delete OUT first instead of resuming.")
def main(**values):
    """Replace every assistant turn of DATA with the target's own answers (MODEL in process, or the server at
    ENDPOINT); write a dataset to OUT."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    overwrite, generation = values.pop("overwrite"), take(GenerationSettings, values)
    job = validated(RegenConfig(**values, generation=generation))
    if job.endpoint is None:
        if problem := model_folder_problem(job.model):
            raise click.BadParameter(problem, param_hint="--model")
        usable_device(job.device)
    try:
        metadata = regenerate(job, overwrite=overwrite)
    except EndpointDown as err:
        raise click.ClickException(f"regeneration stopped: {err}") from err
    c = metadata["counts"]
    click.echo(f"{c['rows_out']}/{c['rows_in']} rows, {c['turns_regenerated']} turns regenerated "
               f"({c['truncated_turns']} truncated), skipped {c['skipped'] or 'none'} -> {job.out}")


if __name__ == "__main__":
    main()
