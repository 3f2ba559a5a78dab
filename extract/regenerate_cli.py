"""Command line of regeneration (`dflash-regenerate`, `python -m dflash.extract.regenerate_cli`,
`make regenerate`): the in-process engine (`--model`) or a server (`--endpoint`)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Literal

import click

from dflash.shared.cli_options import (CONTEXT_SETTINGS, build, looks_like_path, options, usable_device,
                                       validated)

from .data import DataError
from .endpoint import EndpointConfig, EndpointDown
from .regenerate import GenerationSettings, RegenConfig, regenerate
from .self_prompts import SelfPromptSettings


@dataclass(kw_only=True)
class RegenerateOptions:
    """Every flag of ``dflash-regenerate``; it becomes a ``RegenConfig``."""

    data: str | None = None
    """Source chat dataset (anything extract reads); optional with --self-prompts."""
    model: str | None = None
    """Target model: HF folder or hub name (in process); with --endpoint, the served model's name (default: the one
    the server lists)."""
    endpoint: str | None = None
    """OpenAI-compatible server base URL, e.g. http://HOST:8000/v1 (vLLM, SGLang, transformers serve)."""
    out: str
    """Output folder (rerun to resume)."""
    split: str = RegenConfig.split
    """Source dataset split."""
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    self_prompting: SelfPromptSettings = field(default_factory=SelfPromptSettings)
    batch_size: int = RegenConfig.batch_size
    """Prompts per generate() call (in process only)."""
    concurrency: int = RegenConfig.concurrency
    """Conversations in flight at once (--endpoint)."""
    request_timeout: float = EndpointConfig.request_timeout
    """Seconds for one request (--endpoint)."""
    retries: int = EndpointConfig.retries
    """Retries of a failed request (connection error, timeout, 429, 5xx), backoff 1 s doubling (--endpoint)."""
    extra_body: dict = field(default_factory=dict)
    """JSON merged into every request, e.g. '{"top_k": -1}' (--endpoint)."""
    api_key: str | None = field(default=None, metadata={"envvar": "OPENAI_API_KEY"})
    """Bearer token (--endpoint)."""
    part_size: int = RegenConfig.part_size
    """Source rows per output part (the resume unit)."""
    limit: int | None = None
    """Use the first N source rows."""
    device: str = RegenConfig.device
    """cpu, cuda or cuda:N (in process only)."""
    static_cache: bool | None = None
    """Static KV cache, decode step compiled into CUDA graphs (in process; default: on for cuda)."""
    on_bad_row: Literal["skip", "error"] = RegenConfig.on_bad_row
    """Source rows that do not normalise and requests the server rejects: skip and count them, or stop."""
    overwrite: bool = False
    """Delete OUT first instead of resuming."""

    def validate(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        self.self_prompting.validate()
        if self.self_prompting.self_prompts and (self.endpoint is not None or self.model is None):
            raise ValueError("--self-prompts needs the target in process: give --model, without --endpoint (a chat "
                             "API cannot continue a bare user header)")
        if self.endpoint is None and self.model is None:
            raise ValueError("give --model (in process) or --endpoint (a server)")
        if self.endpoint is None and looks_like_path(self.model) and not os.path.isdir(os.path.expanduser(self.model)):
            raise ValueError(f"--model {self.model} is not a folder; pass an existing model folder or a hub name")
        if self.data is None and not self.self_prompting.self_prompts:
            raise ValueError("give --data (a chat dataset) or --self-prompts N (questions the target writes itself)")
        self.generation.validate()
        for name in ("batch_size", "concurrency", "part_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be at least 1, got {self.limit}")
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}")
        if self.retries < 0:
            raise ValueError(f"retries must be 0 or more, got {self.retries}")

    def job(self) -> RegenConfig:
        """The job: through the server with --endpoint, else with the target in process."""
        endpoint = None
        if self.endpoint is not None:
            endpoint = EndpointConfig(url=self.endpoint, api_key=self.api_key, request_timeout=self.request_timeout,
                                      retries=self.retries)
        return RegenConfig(data=self.data, model=self.model, out=self.out, split=self.split,
                           generation=self.generation, endpoint=endpoint, concurrency=self.concurrency,
                           extra_body=self.extra_body, batch_size=self.batch_size, part_size=self.part_size,
                           limit=self.limit, device=self.device, static_cache=self.static_cache,
                           on_bad_row=self.on_bad_row, self_prompting=self.self_prompting)


@click.command(context_settings=CONTEXT_SETTINGS)
@options(RegenerateOptions)
def cli(**values):
    """Replace every assistant turn of DATA with the target's own answers (MODEL in process, or the server at
    ENDPOINT), and/or add SELF_PROMPTS questions the target writes and answers itself; write a dataset to OUT."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    opts = validated(build(RegenerateOptions, values))
    if opts.endpoint is None:
        usable_device(opts.device)
    job = opts.job()
    try:
        if job.endpoint is not None:
            from .regenerate_endpoint import regenerate_via_endpoint

            metadata = regenerate_via_endpoint(job, overwrite=opts.overwrite)
        else:
            metadata = regenerate(job, overwrite=opts.overwrite)
    except EndpointDown as err:
        raise click.ClickException(f"regeneration stopped: {err}") from err
    except (DataError, ValueError) as err:
        raise click.ClickException(str(err)) from err
    c = metadata["counts"]
    click.echo(f"{c['rows_out']}/{c['rows_in']} rows, {c['turns_regenerated']} turns regenerated "
               f"({c['truncated_turns']} truncated), skipped {c['skipped'] or 'none'}"
               + (f", self-prompted questions {c['self_prompts']}" if "self_prompts" in c else "") + f" -> {opts.out}")


def main(argv: list[str] | None = None, prog_name: str | None = None) -> None:
    cli.main(args=argv, prog_name=prog_name, standalone_mode=True)


if __name__ == "__main__":
    main()
