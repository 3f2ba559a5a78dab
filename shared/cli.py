"""What every dflash command shares: click settings, the value types click lacks (comma lists, ``none``, JSON
objects, model folders), and bad input ending in one line that names what to fix, never a traceback."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import typing

import click

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 120, "show_default": True}


@contextlib.contextmanager
def reading(flag: str | None = None):
    """Around code that reads ``flag``'s input: bad input (a missing file, a value that cannot work) becomes one line
    naming the flag (click.BadParameter, exit status 2), or without a flag a click error (exit status 1)."""
    try:
        yield
    except click.ClickException:
        raise
    except Exception as e:
        from .cache import CacheError  # on the error path only: it imports torch and zarr

        if not isinstance(e, (ValueError, OSError, CacheError)):
            raise
        message = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else str(e)
        raise (click.BadParameter(message, param_hint=flag) if flag else click.ClickException(message)) from e


class Command(click.Command):
    """A dflash command: ``-h``, defaults shown, 120 columns, bad input as one line with exit status 1."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"context_settings": CONTEXT_SETTINGS, **kwargs})

    def invoke(self, ctx: click.Context):
        with reading():
            return super().invoke(ctx)


class Group(Command, click.Group):
    command_class = Command


def validated(obj):
    """``obj`` after its ``validate()``; a ValueError there becomes a click usage error (exit status 2)."""
    try:
        obj.validate()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return obj


def take(cls: type, values: dict):
    """An instance of dataclass ``cls`` from the parsed ``values`` of its fields (removed from ``values``)."""
    return cls(**{f.name: values.pop(f.name) for f in dataclasses.fields(cls)})


class Maybe(click.ParamType):
    """A value of ``inner``, or None for 'none' (``--layers none``, ``--attn-implementation none``)."""

    def __init__(self, inner):
        self.inner = click.types.convert_type(inner)
        choices = getattr(self.inner, "choices", None)
        self.name = "|".join([*choices, "none"]) if choices else f"{self.inner.name}|none"

    def get_metavar(self, param, ctx=None):
        return f"[{self.name}]" if isinstance(self.inner, click.Choice) else None

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.strip().lower() in ("none", "null", ""):
            return None
        return self.inner.convert(value, param, ctx)


class CommaList(click.ParamType):
    """Comma-separated values of ``inner`` (``--layers 1,9,17``; an empty text is the empty list)."""

    def __init__(self, inner):
        self.inner = click.types.convert_type(inner)
        self.name = f"{self.inner.name},..."

    def convert(self, value, param, ctx):
        parts = value.split(",") if isinstance(value, str) else value
        return [self.inner.convert(p.strip() if isinstance(p, str) else p, param, ctx) for p in parts if str(p).strip()]


class JsonObject(click.ParamType):
    """A JSON object (``--template-kwargs '{"enable_thinking": false}'``)."""

    name = "json"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            self.fail(f"not valid JSON ({e}): {value!r}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail(f"expected a JSON object such as '{{\"enable_thinking\": false}}', got {value!r}", param, ctx)
        return parsed


def looks_like_path(name: str) -> bool:
    """A local path rather than a hub id ('org/name' or 'name')."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def model_folder_problem(name: str, needs: str | None = "config.json") -> str | None:
    """Why ``name``, where it looks like a local path, is no model folder: missing, or without ``needs``."""
    folder, local = os.path.expanduser(name), looks_like_path(name)
    if local and not os.path.isdir(folder):
        return f"{name} is not a folder; pass an existing model folder or a hub name (org/name)"
    if local and needs and not os.path.isfile(os.path.join(folder, needs)):
        return f"{name} holds no {needs}, so it is not a model folder (save_pretrained writes one)"
    return None


class ModelPath(click.ParamType):
    """A model folder (holding ``needs``) or a hub name."""

    name = "text"

    def __init__(self, needs: str | None = "config.json"):
        self.needs = needs

    def convert(self, value, param, ctx):
        if value and (problem := model_folder_problem(value, self.needs)):
            self.fail(problem, param, ctx)
        return value


def usable_device(device: str) -> str:
    """``device`` ('auto', 'cpu', 'cuda' or 'cuda:N') where this machine has it, else click.BadParameter."""
    kind, _, index = device.partition(":")
    if device == "auto" or kind == "cpu":
        return device
    if kind != "cuda" or (index and not index.isdigit()):
        raise click.BadParameter(f"{device!r} is not a device; use cpu, cuda or cuda:N", param_hint="--device")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(index or 0) >= count:
        raise click.BadParameter(f"{device}: this machine has {count} visible CUDA devices; use --device cpu",
                                 param_hint="--device")
    return device


def check_choices(obj) -> None:
    """Raise ValueError naming the first ``Literal`` field of dataclass ``obj`` (nested too) holding another value."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            check_choices(value)
        elif typing.get_origin(hint) is typing.Literal and value not in typing.get_args(hint):
            raise ValueError(f"{f.name} must be one of {', '.join(map(repr, typing.get_args(hint)))}, got {value!r}")
