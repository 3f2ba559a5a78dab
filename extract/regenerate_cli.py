"""Command line of regeneration (`dflash-regenerate`, `python -m dflash.extract.regenerate`,
`make regenerate`): the in-process engine (`--model`) or a server (`--endpoint`)."""

from __future__ import annotations

import json
import logging

import click

from .data import DataError
from .regenerate import GenerationSettings, RegenConfig, regenerate


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--data", required=True, help="Source chat dataset (anything extract reads).")
@click.option("--model", default=None,
              help="Target model: HF folder or hub name (in process); with --endpoint, the served model's name "
                   "(default: the one the server lists).")
@click.option("--endpoint", default=None,
              help="OpenAI-compatible server base URL, e.g. http://HOST:8000/v1 (vLLM, SGLang, transformers serve).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output folder (resumable).")
@click.option("--split", default="train", show_default=True)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float, help="Nucleus mass when sampling.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--max-new-tokens", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Per turn (max_tokens of each request with --endpoint).")
@click.option("--max-prompt-tokens", default=None, type=click.IntRange(min=1),
              help="Cut a conversation before a turn whose prompt is longer.")
@click.option("--drop-truncated", is_flag=True, help="Cut a conversation at a turn that hit --max-new-tokens.")
@click.option("--batch-size", default=16, show_default=True, type=click.IntRange(min=1), help="In process only.")
@click.option("--concurrency", default=32, show_default=True, type=click.IntRange(min=1),
              help="--endpoint: conversations in flight at once.")
@click.option("--request-timeout", default=600.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="--endpoint: seconds for one request.")
@click.option("--retries", default=6, show_default=True, type=click.IntRange(min=0),
              help="--endpoint: retries of a failed request (connection error, timeout, 429, 5xx), backoff 1 s doubling.")
@click.option("--extra-body", default=None, help="--endpoint: JSON merged into every request, e.g. '{\"top_k\": -1}'.")
@click.option("--api-key", default=None, envvar="OPENAI_API_KEY", help="--endpoint: bearer token (or $OPENAI_API_KEY).")
@click.option("--part-size", default=256, show_default=True, type=click.IntRange(min=1),
              help="Source rows per output part.")
@click.option("--limit", default=None, type=click.IntRange(min=1), help="Use the first N source rows.")
@click.option("--device", default="cpu", show_default=True, help="In process only.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True,
              help="In process only.")
@click.option("--template-kwargs", default=None,
              help='JSON for the chat template, e.g. \'{"enable_thinking": false}\' (chat_template_kwargs with --endpoint).')
@click.option("--on-bad-row", type=click.Choice(["skip", "error"]), default="skip", show_default=True)
@click.option("--overwrite", is_flag=True, help="Delete OUT first instead of resuming.")
def cli(data, model, endpoint, out, split, temperature, top_p, seed, max_new_tokens, max_prompt_tokens,
        drop_truncated, batch_size, concurrency, request_timeout, retries, extra_body, api_key, part_size, limit,
        device, dtype, template_kwargs, on_bad_row, overwrite):
    """Replace every assistant turn of DATA with the target's own answers (MODEL in process, or the server at
    ENDPOINT); write a dataset to OUT."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if endpoint is None and model is None:
        raise click.UsageError("give --model (in process) or --endpoint (a server)")
    settings = GenerationSettings(temperature=temperature, top_p=top_p, seed=seed, max_new_tokens=max_new_tokens,
                                  max_prompt_tokens=max_prompt_tokens, drop_truncated=drop_truncated,
                                  template_kwargs=_json_object(template_kwargs, "--template-kwargs"), dtype=dtype)
    try:
        if endpoint is not None:
            from .endpoint import EndpointConfig
            from .regenerate_endpoint import EndpointJob, regenerate_via_endpoint

            job = EndpointJob(data=data, out=out, model=model, split=split, generation=settings,
                              endpoint=EndpointConfig(url=endpoint, api_key=api_key, request_timeout=request_timeout,
                                                      retries=retries),
                              extra_body=_json_object(extra_body, "--extra-body"), concurrency=concurrency,
                              part_size=part_size, limit=limit, on_bad_row=on_bad_row)
            metadata = regenerate_via_endpoint(job, overwrite=overwrite)
        else:
            cfg = RegenConfig(data=data, model=model, out=out, split=split, generation=settings,
                              batch_size=batch_size, part_size=part_size, limit=limit, device=device,
                              on_bad_row=on_bad_row)
            metadata = regenerate(cfg, overwrite=overwrite)
    except (DataError, ValueError) as err:
        raise click.ClickException(str(err)) from err
    c = metadata["counts"]
    click.echo(f"{c['rows_out']}/{c['rows_in']} rows, {c['turns_regenerated']} turns regenerated "
               f"({c['truncated_turns']} truncated), skipped {c['skipped'] or 'none'} -> {out}")


def _json_object(text: str | None, flag: str) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise click.BadParameter(f"not JSON: {err}", param_hint=flag) from err
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object", param_hint=flag)
    return value


def main(argv: list[str] | None = None, prog_name: str | None = None) -> None:
    cli.main(args=argv, prog_name=prog_name, standalone_mode=True)


if __name__ == "__main__":
    main()
