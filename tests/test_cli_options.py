"""The commands' flags against the settings they fill: one flag per config field and one field per flag,
the flags' defaults the fields' defaults, --help's defaults typed back the same values, choices refused
at parse time."""

from __future__ import annotations

import dataclasses
import json
import re
import typing

import click
import pytest
from click.core import ParameterSource
from click.testing import CliRunner

from dflash.eval.cli import cli as eval_cli
from dflash.extract.cli import main as extract_main
from dflash.extract.config import ZSTD_LEVELS, ExtractConfig
from dflash.extract.regenerate import GenerationSettings, RegenConfig
from dflash.extract.regenerate_cli import main as regenerate_cli
from dflash.shared import cache_cli
from dflash.shared.cli import Maybe, take
from dflash.shared.convert import ConvertSettings
from dflash.train import config as train_config
from dflash.train.cli import cli as train_cli
from dflash.train.config import TrainConfig


def leaf_fields(obj) -> dict[str, tuple[typing.Any, typing.Any]]:
    """name -> (annotation, value) of dataclass instance ``obj``, nested dataclass fields expanded."""
    hints = typing.get_type_hints(type(obj))
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(leaf_fields(value))
        else:
            out[f.name] = (hints[f.name], value)
    return out


def commands(tmp_path) -> list[tuple[str, click.Command, list[str]]]:
    """(label, command, argv that fills every required parameter)."""
    folder = str(tmp_path)
    return [
        ("extract", extract_main, ["--data", "d", "--model", "m", "--out", "o"]),
        ("regenerate", regenerate_cli, ["--data", "d", "--out", "o", "--model", "m"]),
        ("train run", train_cli.commands["run"], []),
        ("train export", train_cli.commands["export"], [folder, "--out", "o"]),
        ("eval", eval_cli, ["--target", "t", "--drafter", folder, "--prompts", "p"]),
        ("cache info", cache_cli.main.commands["info"], ["c"]),
        ("cache show", cache_cli.main.commands["show"], ["c", "3"]),
        ("cache verify", cache_cli.main.commands["verify"], ["c"]),
        ("cache stats", cache_cli.main.commands["stats"], ["c"]),
        ("cache convert", cache_cli.main.commands["convert"], ["s", "d"]),
    ]


def parse(command: click.Command, argv: list[str]) -> dict[str, typing.Any]:
    return dict(command.make_context("x", list(argv)).params)


def settings_of(label: str, params: dict) -> tuple[list, set[str]]:
    """(config objects built from a command's parsed values, the names of its flags that are no config field)."""
    params = dict(params)
    if label == "extract":
        return [ExtractConfig(**params)], set()
    if label == "train run":
        cfg = TrainConfig()
        return [cfg.override(**{k: v for k, v in params.items() if k not in ("preset", "print_config")
                                and v is not None})], {"preset", "print_config"}
    if label == "regenerate":
        generation = take(GenerationSettings, params)
        params.pop("overwrite")
        return [generation, RegenConfig(**params)], {"overwrite"}
    assert label == "cache convert"
    own = {k: params.pop(k) for k in ("src", "dst", "progress", "as_json")}
    return [ConvertSettings(**params)], set(own)


BUILT = ("extract", "train run", "regenerate", "cache convert")


def test_every_field_is_a_flag_and_every_flag_a_field(tmp_path):
    """Each command that fills a config: every field of it has the flag of the same name, of its kind."""
    for label, command, argv in commands(tmp_path):
        if label not in BUILT:
            continue
        built, own = settings_of(label, parse(command, argv))
        fields = {}
        for obj in built:
            fields.update(leaf_fields(obj))
        if label == "regenerate":
            fields = {k: v for k, v in fields.items() if k not in ("retry_wait", "progress")}
        params = {p.name: p for p in command.params}
        assert set(params) - own == set(fields), (label, set(params) - own ^ set(fields))
        for name, (hint, _) in fields.items():
            param = params[name]
            if isinstance(param, click.Argument):
                continue
            assert "--" + name.replace("_", "-") in param.opts, (label, name, param.opts)
            if hint in (bool, bool | None):
                assert param.secondary_opts == ["--no-" + name.replace("_", "-")], (label, name)
            inner = param.type.inner if isinstance(param.type, Maybe) else param.type
            if typing.get_origin(hint) is typing.Literal:
                assert list(inner.choices) == [str(c) for c in typing.get_args(hint)], (label, name)


def test_parsed_defaults_are_the_config_defaults(tmp_path):
    """Only the required parameters given: the parsed values build the configs their own defaults build."""
    for label, command, argv in commands(tmp_path):
        if label not in BUILT:
            continue
        built, _ = settings_of(label, parse(command, argv))
        if label == "extract":
            assert built == [ExtractConfig("d", "m", "o")]
        elif label == "train run":
            assert built == [train_config.dflash_recipe()]
        elif label == "regenerate":
            assert built == [GenerationSettings(), RegenConfig("d", "m", "o")]
        else:
            assert built == [ConvertSettings()]


def test_train_run_defaults_are_the_dflash_presets():
    """What ``dflash-train run --help`` shows is the dflash preset (only given flags override a preset)."""
    ctx = train_cli.commands["run"].make_context("run", [])
    shown = {k: v for k, v in ctx.params.items() if v is not None and k not in ("preset", "print_config")}
    recipe = leaf_fields(train_config.dflash_recipe())
    assert shown == {k: v for k, (_, v) in recipe.items() if k in shown}
    assert {k for k, (_, v) in recipe.items() if v not in (None, "")} == set(shown)


def _shown_default(param: click.Parameter, ctx: click.Context) -> str | None:
    record = param.get_help_record(ctx)
    match = re.search(r"\[default: (.*?)(?:; [^\]]+)?\]$", record[1]) if record else None
    return match.group(1) if match else None


def test_help_shows_each_default_as_typed_and_every_flag_has_help(tmp_path):
    for label, command, argv in commands(tmp_path):
        ctx = command.make_context(label, list(argv))
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden:
                continue
            assert param.help, (label, param.name)
            if ctx.get_parameter_source(param.name) is not ParameterSource.DEFAULT:
                continue  # a required one, given
            shown, value = _shown_default(param, ctx), ctx.params[param.name]
            if isinstance(value, bool) and param.secondary_opts:
                assert shown == (param.opts[0] if value else param.secondary_opts[0])[2:], (label, param.name, shown)
            elif value in (None, "") or param.required:
                assert shown is None, (label, param.name, shown)
            else:  # what --help shows, typed back in, is the default
                assert param.type_cast_value(ctx, shown) == value, (label, param.name, shown, value)


def test_arguments_are_named_in_the_help(tmp_path):
    for label, command, _ in commands(tmp_path):
        text = CliRunner().invoke(command, ["--help"]).output.split("Options:")[0]
        for param in command.params:
            if isinstance(param, click.Argument):
                assert text.count(param.human_readable_name) >= 2, (label, param.name, text)  # usage and the doc


def test_a_bad_choice_is_a_usage_error_naming_the_choices(tmp_path):
    """Every choice of every command: a value outside it stops at parse time with exit 2 and the list."""
    checked = 0
    for label, command, argv in commands(tmp_path):
        for param in command.params:
            choice = param.type.inner if isinstance(param.type, Maybe) else param.type
            if not isinstance(choice, click.Choice):
                continue
            result = CliRunner().invoke(command, [*argv, param.opts[0], "bogus"])
            assert result.exit_code == 2, (label, param.name, result.output)
            assert "bogus" in result.output and param.opts[0] in result.output, result.output
            for value in choice.choices:
                assert repr(value) in result.output, (label, param.name, value, result.output)
            checked += 1
    assert checked >= 20


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

    def parsed(*argv):
        return ExtractConfig(**parse(extract_main, [*base, *argv]))

    assert parsed("--layers", "1,9, 17").layers == [1, 9, 17]
    assert parsed("--layers", "none").layers is None
    assert parsed("--shards", "none").shards is None and parsed("--shards", "3").shards == 3
    assert parsed("--attn-implementation", "none").attn_implementation is None
    assert parsed("--attn-implementation", "eager").attn_implementation == "eager"
    assert parsed("--no-progress").progress is False and parsed("--progress").progress is True
    assert parsed("--template-kwargs", '{"enable_thinking": false}').template_kwargs == {"enable_thinking": False}
    assert parsed("--cpu-threads", "none").cpu_threads is None and parsed("--cpu-threads", "3").cpu_threads == 3
    assert parsed("--commit-seconds", "2.5").commit_seconds == 2.5
    with pytest.raises(click.BadParameter, match="'x' is not a valid int"):
        parsed("--layers", "1,x")
    with pytest.raises(click.BadParameter, match="not valid JSON"):
        parsed("--template-kwargs", "{x")
    with pytest.raises(click.BadParameter, match="expected a JSON object"):
        parsed("--template-kwargs", "[1]")
    with pytest.raises(click.BadParameter, match="does not exist"):
        parsed("--chat-template", str(tmp_path / "missing.jinja"))

    show = cache_cli.main.commands["show"]
    assert parse(show, ["c", "7"])["color"] is None and parse(show, ["c", "7", "--color"])["color"] is True
    assert parse(show, ["c", "7", "--no-color"])["color"] is False and parse(show, ["c", "7"])["index"] == 7
    convert = parse(cache_cli.main.commands["convert"], ["s", "d", "--hidden-codec", "fp8", "--topk-dtype", "none"])
    assert convert["hidden_codec"] == "fp8" and convert["topk_dtype"] is None

    regen = parse(regenerate_cli, ["--data", "d", "--out", "o", "--temperature", "0.5", "--max-prompt-tokens", "none",
                                   "--drop-truncated"])
    got = take(GenerationSettings, regen)
    assert got.temperature == 0.5 and got.max_prompt_tokens is None
    assert got.drop_truncated is True and got.max_new_tokens == 1024
    monkeypatch.setenv("OPENAI_API_KEY", "secret")
    assert parse(regenerate_cli, ["--data", "d", "--out", "o"])["api_key"] == "secret"


def test_train_flags_override_only_what_is_given_over_the_preset(tmp_path):
    out = CliRunner().invoke(train_cli, ["run", "--preset", "tiny", "--lr", "1e-2", "--target-layer-ids", "1,2",
                                         "--device", "auto", "--print-config"])
    assert out.exit_code == 0, out.output
    want = train_config.tiny().override(lr=1e-2, target_layer_ids=[1, 2], device="auto")
    assert json.loads(out.output) == want.to_dict()
    ctx = train_cli.commands["run"].make_context("run", ["--lr", "1e-2"])
    assert [k for k in ctx.params if ctx.get_parameter_source(k) is ParameterSource.COMMANDLINE] == ["lr"]
    with pytest.raises(KeyError, match="no field 'drafter'"):
        TrainConfig().override(drafter=None)


def test_usage_errors_from_validate_and_missing_model_or_endpoint(tmp_path):
    missing = CliRunner().invoke(regenerate_cli, ["--data", "d", "--out", str(tmp_path / "o")])
    assert missing.exit_code == 2 and "give --model (in process) or --endpoint (a server)" in missing.output
    no_url = CliRunner().invoke(regenerate_cli, ["--data", "d", "--out", str(tmp_path / "o"), "--endpoint", "host:8000"])
    assert no_url.exit_code == 2 and "--endpoint host:8000: give the server's base URL" in no_url.output
    zero = CliRunner().invoke(extract_main, ["--data", "d", "--model", "m", "--out", "o", "--topk", "0"])
    assert zero.exit_code == 2 and "topk must be at least 1, got 0" in zero.output
    no_file = CliRunner().invoke(eval_cli, ["--target", "t", "--drafter", str(tmp_path / "nope"), "--prompts", "p"])
    assert no_file.exit_code == 2 and "does not exist" in no_file.output
    for command, argv, flag in ((eval_cli, ["--target", "t", "--drafter", str(tmp_path), "--prompts", "p"],
                                 "--max-new-tokens"), (regenerate_cli, ["--data", "d", "--out", "o"], "--batch-size")):
        result = CliRunner().invoke(command, [*argv, flag, "0"])
        assert result.exit_code == 2 and flag in result.output and "0 is not in the range" in result.output
