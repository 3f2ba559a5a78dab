"""Command-line flags generated from dataclass fields, the same way for every CLI.

Each flag's name, type, default, help and choices are written once, in its field: the
annotation gives the type (``Literal`` choices, ``X | None`` takes ``none``, ``list[X]``
is comma-separated, ``dict`` is a JSON object, ``bool`` is ``--flag/--no-flag``), the
default is the field's, and the help is the string literal written under the field. A
field whose type is a dataclass contributes its own fields (flat names, unique across
the tree). Per-field ``metadata`` (``dataclasses.field``) adds what the type cannot say:
``argument`` (positional), ``flag`` (another spelling), ``hidden``, ``envvar``,
``exists`` ("file" or "dir": the path must exist; "model": a folder or hub name, and a
value that looks like a local path must be an existing folder) and ``multiple`` (a
``list[X]`` flag given once per value).

Bad input ends in one line naming what to fix, never a traceback: a command built with
``options`` shows the expected errors of bad input (ValueError, OSError, CacheError) as
click errors (exit status 1), and ``reading(flag)`` names the flag whose input failed.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import json
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal

import click
from click.core import ParameterSource

NONE_WORDS = ("none", "null", "")
"""What an optional flag accepts for None (``--layers none``)."""
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 120}
"""The click context settings of every command (``-h`` for help, help up to 120 columns wide)."""


@dataclass(frozen=True)
class FieldFlag:
    """One dataclass field as one command-line parameter."""

    name: str
    """The field's name, also the click parameter's name."""
    path: tuple[str, ...]
    """Names of the nested dataclass fields that lead to it (empty at the top)."""
    hint: Any
    """The resolved annotation."""
    default: Any
    """The default value (its factory called), or ``dataclasses.MISSING`` when required."""
    doc: str
    """The one-line doc written under the field."""
    metadata: dict[str, Any]
    """The field's ``metadata``."""

    @property
    def flag(self) -> str:
        return self.metadata.get("flag", "--" + self.name.replace("_", "-"))

    @property
    def is_argument(self) -> bool:
        return bool(self.metadata.get("argument"))


@functools.lru_cache(maxsize=None)
def _module_tree(filename: str) -> ast.Module:
    """A source file parsed once (``inspect.getsource`` would tokenize the file again for every class)."""
    with open(filename, encoding="utf-8") as f:
        return ast.parse(f.read(), filename)


def _class_node(cls: type) -> ast.ClassDef:
    scope: list[ast.stmt] = _module_tree(inspect.getsourcefile(cls)).body
    for name in cls.__qualname__.split("."):
        node = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == name), None)
        if node is None:
            raise TypeError(f"cannot find the source of {cls.__qualname__} (needed for its field docs)")
        scope = node.body
    return node


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal under it in ``cls``'s source (whitespace collapsed)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = _class_node(klass).body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.lru_cache(maxsize=None)
def field_flags(cls: type) -> tuple[FieldFlag, ...]:
    """Every leaf field of dataclass ``cls`` (nested dataclass fields expanded), in order."""
    out: list[FieldFlag] = []
    _collect(cls, (), out)
    seen: set[str] = set()
    for f in out:
        if f.name in seen:
            raise TypeError(f"{cls.__name__}: field name {f.name!r} appears twice; flags need unique names")
        seen.add(f.name)
    return tuple(out)


def _collect(cls: type, path: tuple[str, ...], out: list[FieldFlag]) -> None:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            _collect(hint, path + (f.name,), out)
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        if f.name not in docs and not f.metadata.get("hidden"):
            raise TypeError(f"{cls.__name__}.{f.name} has no doc string under it (it is the flag's help)")
        out.append(FieldFlag(f.name, path, hint, default, docs.get(f.name, ""), dict(f.metadata)))


# ----------------------------------------------------------------------------- types


def _optional_inner(hint: Any) -> tuple[Any, bool]:
    """(X, True) for ``X | None``, else (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0], True
    return hint, False


def choices_of(hint: Any) -> tuple | None:
    """The allowed values of a ``Literal`` annotation (optional or not), else None."""
    inner, _ = _optional_inner(hint)
    return typing.get_args(inner) if typing.get_origin(inner) is Literal else None


class ValueType(click.ParamType):
    """Flag text -> a value of one annotation: scalars, ``Literal``, ``list[X]``, ``dict``, ``X | None``."""

    def __init__(self, hint: Any):
        self.hint = hint
        inner, self.optional = _optional_inner(hint)
        self.origin = typing.get_origin(inner) or inner
        self.inner = inner
        scalar = (typing.get_args(inner) or (None,))[0] if self.origin is list else inner
        if self.origin is not dict and scalar not in (int, float, str, bool) and typing.get_origin(scalar) is not Literal:
            raise TypeError(f"no command-line type for the annotation {hint!r}")
        self.name = self._describe()

    def _describe(self) -> str:
        if self.origin is Literal:
            text = "|".join(str(c) for c in typing.get_args(self.inner))
        elif self.origin is list:
            text = f"{_scalar_name(typing.get_args(self.inner)[0])},..."
        elif self.origin is dict:
            text = "JSON"
        else:
            text = _scalar_name(self.inner)
        return f"{text}|none" if self.optional else text

    def get_metavar(self, param, ctx=None) -> str:  # click >= 8.2 passes ctx
        return "[" + self.name + "]" if self.origin is Literal else self.name.upper()

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value  # a default already of the field's type
        if self.optional and value.strip().lower() in NONE_WORDS:
            return None
        if self.origin is list:
            (item,) = typing.get_args(self.inner)
            return [self._scalar(item, part.strip(), param, ctx) for part in value.split(",") if part.strip()]
        if self.origin is dict:
            return self._json_object(value, param, ctx)
        return self._scalar(self.inner, value, param, ctx)

    def _scalar(self, kind: Any, text: str, param, ctx):
        if typing.get_origin(kind) is Literal:
            allowed = typing.get_args(kind)
            for choice in allowed:
                if text == str(choice):
                    return choice
            shown = ", ".join(repr(str(c)) for c in allowed)
            self.fail(f"{text!r} is not one of {shown}", param, ctx)
        if kind is bool:
            return click.BOOL.convert(text, param, ctx)
        if kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                self.fail(f"{text!r} is not a valid {kind.__name__}", param, ctx)
        return text

    def _json_object(self, text: str, param, ctx) -> dict:
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as e:
            self.fail(f"not valid JSON ({e}): {text!r}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail(f"expected a JSON object such as '{{\"enable_thinking\": false}}', got {text!r}", param, ctx)
        return parsed


def _scalar_name(kind: Any) -> str:
    return {int: "int", float: "float", str: "text", bool: "bool"}.get(kind, getattr(kind, "__name__", str(kind)))


def flag_text(value: Any) -> str | Any:
    """A default as the text one would type for it (lists comma-joined, dicts as JSON)."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value)
    return value


def looks_like_path(name: str) -> bool:
    """A local path rather than a hub id ('org/name' or 'name')."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


class ModelPath(click.ParamType):
    """A model folder or hub name; one that looks like a local path must be an existing folder
    (else transformers reports a malformed hub id, naming neither the flag nor the fix)."""

    name = "text"

    def __init__(self, optional: bool):
        self.optional = optional

    def convert(self, value, param, ctx):
        if self.optional and isinstance(value, str) and value.strip().lower() in NONE_WORDS:
            return None
        if value and looks_like_path(value) and not os.path.isdir(os.path.expanduser(value)):
            self.fail(f"{value} is not a folder; pass an existing model folder or a hub name (org/name)", param, ctx)
        return value


def _click_type(f: FieldFlag):
    exists = f.metadata.get("exists")
    if exists == "model":
        return ModelPath(_optional_inner(f.hint)[1])
    if exists:
        return click.Path(exists=True, dir_okay=exists == "dir", file_okay=exists == "file")
    inner, optional = _optional_inner(f.hint)
    if typing.get_origin(inner) is Literal and not optional:
        return click.Choice([str(c) for c in typing.get_args(inner)])
    if not optional and inner in (int, float, str):
        return {int: click.INT, float: click.FLOAT, str: click.STRING}[inner]
    return ValueType(f.hint)


def _parameter(f: FieldFlag) -> Callable:
    """The click decorator that adds ``f``'s parameter to a command."""
    required = f.default is dataclasses.MISSING
    inner, _ = _optional_inner(f.hint)
    if f.is_argument:
        kwargs = {} if required else {"default": flag_text(f.default), "required": False}
        return click.argument(f.name, type=_click_type(f), **kwargs)
    common = dict(help=f.doc, hidden=bool(f.metadata.get("hidden")), envvar=f.metadata.get("envvar"),
                  show_envvar=bool(f.metadata.get("envvar")))
    if inner is bool:
        flag = f.flag
        return click.option(f"{flag}/--no-{flag[2:]}", f.name, default=None if required else f.default,
                            required=required, show_default=f.default not in (None, dataclasses.MISSING), **common)
    if f.metadata.get("multiple"):  # list[X] given once per value: --flag a --flag b
        return click.option(f.flag, f.name, type=ValueType(typing.get_args(inner)[0]), multiple=True,
                            default=None if required else f.default, required=required, **common)
    kind = _click_type(f)
    if isinstance(kind, click.Choice):
        # Literal values may be ints or bools: hand the field back its own value, not the text.
        kind = _ChoiceOf(typing.get_args(inner), kind.choices)
    default = None if required else flag_text(f.default)
    return click.option(f.flag, f.name, type=kind, default=default, required=required,
                        show_default=default not in (None, ""), **common)


class _ChoiceOf(click.Choice):
    """``click.Choice`` that returns the Literal's own value (``1``, not ``"1"``)."""

    def __init__(self, values: tuple, texts):
        super().__init__(list(texts))
        self.values = dict(zip(texts, values))

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            value = str(value)
        return self.values[super().convert(value, param, ctx)]


# ----------------------------------------------------------------------------- decorators and building


def options(*classes: type) -> Callable:
    """Decorator: one click parameter per field of each dataclass, in field order.

    Positional fields (``metadata={"argument": True}``) are listed, with their docs, at
    the end of the command's help text, since click shows no help for arguments.
    """

    def decorate(fn):
        flags = [f for cls in classes for f in field_flags(cls)]
        arguments = [f for f in flags if f.is_argument]
        if arguments and fn.__doc__:
            lines = "\n".join(f"  {f.name.upper():<10} {f.doc}" for f in arguments)
            fn.__doc__ = inspect.cleandoc(fn.__doc__) + "\n\n\b\nArguments:\n" + lines
        fn = _bad_input_as_click_errors(fn)
        for f in reversed(flags):
            fn = _parameter(f)(fn)
        return fn

    return decorate


def _expected_errors() -> tuple[type[Exception], ...]:
    """The errors that mean bad input (a missing or unreadable file, a value that cannot work)."""
    from .cache import CacheError  # on the error path only: it imports torch and zarr

    return (ValueError, OSError, CacheError)


def _message(e: Exception) -> str:
    if isinstance(e, OSError) and e.filename and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


def _bad_input_as_click_errors(fn: Callable) -> Callable:
    """``fn`` with the expected errors of bad input shown as a click error (exit status 1)."""

    @functools.wraps(fn)
    def command(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except Exception as e:
            if not isinstance(e, _expected_errors()):
                raise
            raise click.ClickException(_message(e)) from e

    return command


def usable_device(device: str, flag: str = "--device") -> str:
    """``device`` ('auto', 'cpu', 'cuda' or 'cuda:N') where this machine has it, else a
    click.BadParameter naming the flag (torch would fail later with an assertion)."""
    kind, _, index = device.partition(":")
    if device == "auto" or kind == "cpu":
        return device
    if kind != "cuda" or (index and not index.isdigit()):
        raise click.BadParameter(f"{device!r} is not a device; use cpu, cuda or cuda:N", param_hint=flag)
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(index or 0) >= count:
        raise click.BadParameter(f"{device}: this machine has {count} visible CUDA devices; use --device cpu",
                                 param_hint=flag)
    return device


@contextlib.contextmanager
def reading(flag: str):
    """Around the code that reads ``flag``'s input: an expected error there becomes a
    click.BadParameter naming the flag (exit status 2)."""
    try:
        yield
    except click.ClickException:
        raise
    except Exception as e:
        if not isinstance(e, _expected_errors()):
            raise
        raise click.BadParameter(_message(e), param_hint=flag) from e


def build(cls: type, values: dict[str, Any]):
    """An instance of ``cls`` from flat parameter values (those not given keep the field default)."""
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[f.name] = build(hint, values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def override(obj: Any, values: dict[str, Any]) -> Any:
    """Set flat field values on ``obj`` (a tree of dataclasses), each where its field lives."""
    where = {f.name: f.path for f in field_flags(type(obj))}
    for name, value in values.items():
        if name not in where:
            raise KeyError(f"{type(obj).__name__} has no field {name!r}")
        target = obj
        for section in where[name]:
            target = getattr(target, section)
        setattr(target, name, value)
    return obj


def given(ctx: click.Context, values: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``values`` the user actually passed (command line or environment)."""
    return {k: v for k, v in values.items()
            if ctx.get_parameter_source(k) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)}


def pick(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` that are fields of ``cls`` (nested ones included)."""
    names = {f.name for f in field_flags(cls)}
    return {k: v for k, v in values.items() if k in names}


def check_choices(obj: Any) -> None:
    """Raise ValueError naming the first ``Literal`` field (nested ones included) holding another value."""
    for f in field_flags(type(obj)):
        allowed = choices_of(f.hint)
        if allowed is None:
            continue
        target = obj
        for section in f.path:
            target = getattr(target, section)
        value = getattr(target, f.name)
        if value is None and _optional_inner(f.hint)[1]:
            continue
        if value not in allowed:
            raise ValueError(f"{f.name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def validated(obj: Any) -> Any:
    """``obj`` after its ``validate()``; a ValueError becomes a click usage error (exit status 2)."""
    try:
        check_choices(obj)
        if hasattr(obj, "validate"):
            obj.validate()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return obj
