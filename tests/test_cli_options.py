"""Every CLI is generated from its dataclasses: one flag per field and one field per flag,
defaults in --help equal to the fields' defaults, Literal choices refused at parse time."""

from __future__ import annotations

import dataclasses
import json
import re
import typing

import click
import pytest
from click.testing import CliRunner

from dflash.eval.cli import EvalConfig
from dflash.eval.cli import cli as eval_cli
from dflash.extract.cli import main as extract_main
from dflash.extract.config import ZSTD_LEVELS, ExtractConfig
from dflash.extract.regenerate_cli import RegenerateOptions
from dflash.extract.regenerate_cli import cli as regenerate_cli
from dflash.shared import cache_cli
from dflash.shared.cli_options import build
from dflash.train import config as train_config
from dflash.train.cli import cli as train_cli
from dflash.train.config import ExportOptions, RunOptions, TrainConfig


def leaf_fields(cls: type) -> dict[str, tuple[typing.Any, typing.Any, dict]]:
    """name -> (annotation, default or MISSING, metadata), nested dataclass fields expanded (a walk of its own)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(leaf_fields(hints[f.name]))
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out[f.name] = (hints[f.name], default, dict(f.metadata))
    return out


# (command, its dataclasses, argv that fills every required parameter)
def commands(tmp_path) -> list[tuple[str, click.Command, tuple[type, ...], list[str]]]:
    folder = str(tmp_path)
    return [
        ("extract", extract_main, (ExtractConfig,), ["--data", "d", "--model", "m", "--out", "o"]),
        ("regenerate", regenerate_cli, (RegenerateOptions,), ["--data", "d", "--out", "o", "--model", "m"]),
        ("train run", train_cli.commands["run"], (RunOptions, TrainConfig), []),
        ("train export", train_cli.commands["export"], (ExportOptions,), [folder, "--out", "o"]),
        ("eval", eval_cli, (EvalConfig,), ["--target", "t", "--drafter", folder, "--prompts", "p"]),
        ("cache info", cache_cli.main.commands["info"], (cache_cli.InfoOptions,), ["c"]),
        ("cache show", cache_cli.main.commands["show"], (cache_cli.ShowOptions,), ["c", "3"]),
        ("cache verify", cache_cli.main.commands["verify"], (cache_cli.VerifyOptions,), ["c"]),
        ("cache stats", cache_cli.main.commands["stats"], (cache_cli.StatsOptions,), ["c"]),
    ]


def flag_of(name: str, metadata: dict) -> str:
    return metadata.get("flag", "--" + name.replace("_", "-"))


def test_every_field_is_a_flag_and_every_flag_a_field(tmp_path):
    for label, command, classes, _ in commands(tmp_path):
        fields = {}
        for cls in classes:
            fields.update(leaf_fields(cls))
        params = {p.name: p for p in command.params if p.name != "help"}
        assert set(params) == set(fields), (label, set(params) ^ set(fields))
        for name, (hint, default, metadata) in fields.items():
            param = params[name]
            if metadata.get("argument"):
                assert isinstance(param, click.Argument), (label, name)
                continue
            assert flag_of(name, metadata) in param.opts, (label, name, param.opts)
            if hint is bool or hint == (bool | None):
                assert param.secondary_opts == ["--no-" + flag_of(name, metadata)[2:]], (label, name)
            assert param.required == (default is dataclasses.MISSING), (label, name)
            assert param.hidden == bool(metadata.get("hidden")), (label, name)


def test_parsed_defaults_are_the_dataclass_defaults(tmp_path):
    """Only a few parameters given: the parsed values build the dataclass its own defaults build."""
    from click.core import ParameterSource

    for label, command, classes, argv in commands(tmp_path):
        ctx = command.make_context(label, list(argv))
        typed = {k: v for k, v in ctx.params.items() if ctx.get_parameter_source(k) == ParameterSource.COMMANDLINE}
        assert len(typed) == sum(not a.startswith("--") for a in argv), label
        for cls in classes:
            own = {k: v for k, v in typed.items() if k in {f.name for f in dataclasses.fields(cls)}}
            assert build(cls, ctx.params) == cls(**own), label


def _shown_default(param: click.Parameter, ctx: click.Context) -> str | None:
    record = param.get_help_record(ctx)
    match = re.search(r"\[default: (.*?)(?:; [a-z ]+)?\]$", record[1]) if record else None
    return match.group(1) if match else None


def test_help_shows_the_dataclass_defaults(tmp_path):
    for label, command, classes, argv in commands(tmp_path):
        ctx = command.make_context(label, list(argv))
        fields = {}
        for cls in classes:
            fields.update(leaf_fields(cls))
        for param in command.params:
            if not isinstance(param, click.Option) or param.name == "help" or param.hidden:
                continue
            hint, default, metadata = fields[param.name]
            shown = _shown_default(param, ctx)
            if default in (None, "", dataclasses.MISSING):
                assert shown is None, (label, param.name, shown)
            elif isinstance(default, bool):
                flag = flag_of(param.name, metadata)[2:]
                assert shown == (flag if default else "no-" + flag), (label, param.name, shown)
            else:
                assert shown is not None, (label, param.name)
                # what --help shows, typed back in, is the field's default
                assert param.type_cast_value(ctx, shown) == default, (label, param.name, shown, default)


def test_help_of_every_command_renders_each_fields_doc(tmp_path):
    for label, command, classes, _ in commands(tmp_path):
        text = "".join(CliRunner().invoke(command, ["--help"]).output.split())  # wrapped anywhere
        for cls in classes:
            for name, (_, _, metadata) in leaf_fields(cls).items():
                if not metadata.get("hidden"):
                    assert "".join(type_doc(cls, name).split()) in text, (label, name)


def type_doc(cls: type, name: str) -> str:
    """The doc string written under field ``name`` in ``cls`` or its nested dataclasses (read with ast)."""
    import ast
    import inspect
    import textwrap

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            try:
                return type_doc(hints[f.name], name)
            except KeyError:
                continue
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    for node, doc in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and node.target.id == name:
            return doc.value.value
    raise KeyError(name)


def test_a_bad_choice_is_a_usage_error_naming_the_choices(tmp_path):
    """Every Literal field of every CLI: a value outside it stops at parse time with exit 2 and the list."""
    checked = 0
    for label, command, classes, argv in commands(tmp_path):
        for cls in classes:
            for name, (hint, _, metadata) in leaf_fields(cls).items():
                if typing.get_origin(hint) is not typing.Literal:
                    continue
                result = CliRunner().invoke(command, [*argv, flag_of(name, metadata), "bogus"])
                assert result.exit_code == 2, (label, name, result.output)
                assert "bogus" in result.output and flag_of(name, metadata) in result.output, result.output
                for choice in typing.get_args(hint):
                    assert repr(str(choice)) in result.output, (label, name, choice, result.output)
                checked += 1
    assert checked >= 12


def test_compile_bf16_is_refused_before_training_and_in_the_config():
    result = CliRunner().invoke(train_cli, ["run", "--cache", "c", "--out", "o", "--compile", "bf16"])
    assert result.exit_code == 2
    assert "'bf16' is not one of 'auto', 'on', 'off'" in result.output
    cfg = TrainConfig()
    cfg.runtime.compile = "bf16"  # set in code, not through the CLI: validate names the choices
    with pytest.raises(ValueError, match="compile must be one of 'auto', 'on', 'off', got 'bf16'"):
        cfg.validate()


def test_compression_level_is_one_the_codec_runs():
    """The accepted levels are exactly those whose zstd frame the cache's blosc codec writes (a zstd frame of
    that level found inside blosc's output); an even level or 17 would silently be another."""
    import numcodecs
    import numpy as np

    from dflash.shared.cache import _compressors

    data = (np.random.default_rng(0).standard_normal(1 << 17) * 50).astype(np.int16).tobytes()

    def blosc_runs_zstd_at(level: int) -> bool:
        clevel = _compressors(2, level)[0].clevel  # the blosc level the cache stores for this zstd level
        blosc = numcodecs.Blosc("zstd", clevel, numcodecs.Blosc.NOSHUFFLE, blocksize=len(data))
        return numcodecs.Zstd(level=level).encode(data) in blosc.encode(data)

    assert [level for level in range(1, 18) if blosc_runs_zstd_at(level)] == list(ZSTD_LEVELS)
    base = ["--data", "d", "--model", "m", "--out", "o"]
    for level in (0, 2, 4, 16, 17, 19, 22):
        result = CliRunner().invoke(extract_main, [*base, "--compression-level", str(level)])
        assert result.exit_code == 2, (level, result.output)
        assert f"--compression-level {level}" in result.output and "1, 3, 5, 7, 9, 11, 13, 15" in result.output


def test_values_of_each_kind_parse_to_the_field_types(tmp_path, monkeypatch):
    base = ["--data", "d", "--model", "m", "--out", "o"]

    def parsed(*argv, command=extract_main, cls=ExtractConfig, head=base):
        return build(cls, command.make_context("x", [*head, *argv]).params)

    assert parsed("--layers", "1,9, 17").layers == [1, 9, 17]
    assert parsed("--layers", "none").layers is None
    assert parsed("--shards", "none").shards is None and parsed("--shards", "3").shards == 3
    assert parsed("--attn-implementation", "none").attn_implementation is None
    assert parsed("--attn-implementation", "eager").attn_implementation == "eager"
    assert parsed("--no-progress").progress is False and parsed("--progress").progress is True
    assert parsed("--template-kwargs", '{"enable_thinking": false}').template_kwargs == {"enable_thinking": False}
    assert parsed("--cpu-threads", "none").cpu_threads is None and parsed("--cpu-threads", "3").cpu_threads == 3
    assert parsed("--commit-seconds", "2.5").commit_seconds == 2.5
    with pytest.raises(click.BadParameter, match="'1,x' is not a valid int|'x' is not a valid int"):
        parsed("--layers", "1,x")
    with pytest.raises(click.BadParameter, match="does not exist"):
        parsed("--chat-template", str(tmp_path / "missing.jinja"))

    show = dict(command=cache_cli.main.commands["show"], cls=cache_cli.ShowOptions, head=["c", "7"])
    assert parsed(**show).color is None and parsed("--color", **show).color is True
    assert parsed("--no-color", **show).color is False and parsed(**show).index == 7

    regen = dict(command=regenerate_cli, cls=RegenerateOptions, head=["--data", "d", "--out", "o"])
    got = parsed("--temperature", "0.5", "--max-prompt-tokens", "none", "--drop-truncated", **regen)
    assert got.generation.temperature == 0.5 and got.generation.max_prompt_tokens is None
    assert got.generation.drop_truncated is True and got.generation.max_new_tokens == 1024
    monkeypatch.setenv("OPENAI_API_KEY", "secret")
    assert parsed(**regen).api_key == "secret"


def test_train_flags_override_only_what_is_given_over_the_preset(tmp_path):
    out = CliRunner().invoke(train_cli, ["run", "--preset", "tiny", "--lr", "1e-2", "--target-layer-ids", "1,2",
                                         "--device", "auto", "--print-config"])
    assert out.exit_code == 0, out.output
    want = train_config.tiny().override(lr=1e-2, target_layer_ids=[1, 2], device="auto")
    assert json.loads(out.output) == want.to_dict()
    assert set(typing.get_args(train_config.PresetName)) == set(train_config.PRESETS)


def test_usage_errors_from_validate_and_missing_model_or_endpoint(tmp_path):
    missing = CliRunner().invoke(regenerate_cli, ["--data", "d", "--out", str(tmp_path / "o")])
    assert missing.exit_code == 2 and "give --model (in process) or --endpoint (a server)" in missing.output
    zero = CliRunner().invoke(extract_main, ["--data", "d", "--model", "m", "--out", "o", "--topk", "0"])
    assert zero.exit_code == 2 and "topk must be at least 1, got 0" in zero.output
    no_file = CliRunner().invoke(eval_cli, ["--target", "t", "--drafter", str(tmp_path / "nope"), "--prompts", "p"])
    assert no_file.exit_code == 2 and "does not exist" in no_file.output


def test_positional_arguments_are_documented_in_the_help():
    text = CliRunner().invoke(cache_cli.main, ["show", "--help"]).output
    assert re.search(r"CACHE\s+The cache", text) and re.search(r"INDEX\s+Global sample index", text)


@dataclasses.dataclass
class _Inner:
    lr: float = 1.0
    """A nested field."""


@dataclasses.dataclass
class _Clash:
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    lr: float = 2.0
    """The same name as the nested field."""


@dataclasses.dataclass
class _Undocumented:
    steps: int = 3


@dataclasses.dataclass
class _Unsupported:
    shape: tuple[int, int] = (1, 2)
    """No flag type for a tuple."""


def test_the_generator_refuses_what_it_cannot_make_a_flag_of():
    from dflash.shared.cli_options import options

    for cls, message in ((_Clash, "field name 'lr' appears twice"), (_Undocumented, "_Undocumented.steps has no doc"),
                         (_Unsupported, "no command-line type for the annotation tuple")):
        with pytest.raises(TypeError, match=message):
            options(cls)(lambda **values: None)
