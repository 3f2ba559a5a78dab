"""The CPU demo, end to end, in one output folder (``make demo OUT=demo_out``):

    1. synthetic chats (train / held-out)           -> OUT/data/{train,heldout}.jsonl
    2. the demo target (a small Qwen3 trained here)  -> OUT/tokenizer, OUT/target
    3. hidden-state cache of the train chats         -> OUT/cache.zarr   (dflash.extract)
    4. drafter training, then export                 -> OUT/run, OUT/export (dflash.train)
    5. online speculative decoding vs greedy         -> OUT/eval.json    (dflash.eval)
    6. summary and training curves                   -> OUT/summary.json, OUT/training_curves.png

Every step records its settings in a small ``*.demo.json`` marker and is skipped when
the marker matches (a rerun only re-reads the results); a step whose settings changed
is rebuilt from scratch, and so is everything after it. ``--small`` is the reduced
version the test suite runs (tiny sizes, seconds instead of minutes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click


@dataclass
class DemoSettings:
    """Sizes of every step; `full()` is `make demo`, `small()` the test suite's."""

    n_train: int = 800  # training chats (target, cache)
    n_heldout: int = 32  # held-out chats: online evaluation prompts
    seed: int = 0
    target: dict[str, Any] = field(default_factory=lambda: dict(  # DemoTargetConfig overrides
        num_hidden_layers=4, hidden_size=96, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, steps=200, batch_size=16, lr=3e-3, warmup_steps=10, log_every=25))
    extract_workers: int = 2
    batch_tokens: int = 4096
    max_length: int = 256
    # drafter training (overrides of the `tiny` preset)
    train: dict[str, Any] = field(default_factory=lambda: dict(
        block_size=8, num_draft_layers=2, context_buckets=[128, 256], max_anchors=16, batch_size=8,
        micro_batch_size=8, eval_samples=64, max_steps=600, lr=3e-3, warmup_ratio=0.05,
        log_every=10, eval_every=60, save_every=600, keep_checkpoints=1, attention="dense", compile="off",
        autocast="off"))
    max_new_tokens: int = 64
    eval_prompts: int = 32

    @classmethod
    def full(cls) -> "DemoSettings":
        return cls()

    @classmethod
    def small(cls) -> "DemoSettings":
        return cls(
            n_train=32, n_heldout=4, extract_workers=1, batch_tokens=2048,
            target=dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, steps=8, batch_size=8, lr=1e-2, warmup_steps=2,
                        log_every=4),
            train=dict(block_size=4, num_draft_layers=1, context_buckets=[128, 256], max_anchors=8, batch_size=8,
                       micro_batch_size=8, eval_samples=8, max_steps=8, lr=3e-3, log_every=2, eval_every=4,
                       save_every=8, keep_checkpoints=1, attention="dense", compile="off", autocast="off"),
            max_new_tokens=16, eval_prompts=3)


# --------------------------------------------------------------------------- step markers


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".demo.json")


def _read(path: Path) -> dict | None:
    try:
        return json.loads(_marker(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _write(path: Path, settings: dict, **extra: Any) -> None:
    _marker(path).write_text(json.dumps({"settings": settings, **extra}, indent=2, default=str) + "\n")


def _fresh(path: Path, settings: dict) -> dict | None:
    """The marker record when `path` was built with `settings`; else clear `path` and return None."""
    record = _read(path)
    if record is not None and record.get("settings") == json.loads(json.dumps(settings, default=str)):
        return record
    _marker(path).unlink(missing_ok=True)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    return None


def _hash_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --------------------------------------------------------------------------- the steps


def step_data(out: Path, s: DemoSettings, echo) -> tuple[Path, Path]:
    from dflash.shared import demo_data

    data = out / "data"
    settings = {"n_train": s.n_train, "n_heldout": s.n_heldout, "seed": s.seed}
    if _fresh(data, settings) is not None:
        echo(f"[1/6] data: reusing {data}")
        return data / "train.jsonl", data / "heldout.jsonl"
    chats = demo_data.generate_chats(s.n_train + s.n_heldout, seed=s.seed)
    data.mkdir(parents=True)
    train = demo_data.write_jsonl(chats[: s.n_train], data / "train.jsonl")
    held = demo_data.write_jsonl(chats[s.n_train :], data / "heldout.jsonl")
    _write(data, settings)
    echo(f"[1/6] data: {s.n_train} train + {s.n_heldout} held-out chats -> {data}")
    return train, held


def step_target(out: Path, s: DemoSettings, train_jsonl: Path, echo) -> tuple[Path, dict]:
    from dflash.shared import demo_data, demo_target

    chats = demo_data.read_jsonl(train_jsonl)
    tok_dir = out / "tokenizer"
    tok_settings = {"data": _hash_file(train_jsonl)}
    if _fresh(tok_dir, tok_settings) is None:
        demo_target.build_demo_tokenizer(tok_dir, chats)
        _write(tok_dir, tok_settings)
    t0 = time.perf_counter()
    build = demo_target.build_demo_target(out / "target", train_chats=chats, tokenizer=tok_dir,
                                          log=lambda m: echo("      " + m), **s.target)
    echo(f"[2/6] target: {'reused' if build.reused else 'built'} {build.path} ({time.perf_counter() - t0:.1f} s)")
    return build.path, build.record


def step_extract(out: Path, s: DemoSettings, train_jsonl: Path, target: Path, echo) -> dict:
    from dflash.extract.config import ExtractConfig
    from dflash.extract.runner import run

    cache = out / "cache.zarr"
    settings = {"data": _hash_file(train_jsonl), "target": _hash_file(target / "model.safetensors"),
                "workers": s.extract_workers, "batch_tokens": s.batch_tokens, "max_length": s.max_length}
    if _fresh(cache, settings) is None:
        _write(cache, settings)  # written first: an interrupted extraction resumes in place
    cfg = ExtractConfig(data=str(train_jsonl), model=str(target), out=str(cache), device="cpu",
                        workers=s.extract_workers, batch_tokens=s.batch_tokens, max_length=s.max_length,
                        dtype="float32", commit_seconds=5.0, progress=False,
                        cpu_threads=max(1, (os.cpu_count() or 1) // s.extract_workers))
    t0 = time.perf_counter()
    summary = run(cfg)
    seconds = time.perf_counter() - t0
    size = _du(cache)
    if summary.get("noop"):
        what = "complete already"
        seconds = (_read(cache) or {}).get("extract_seconds", seconds)
    else:
        what = f"extracted in {seconds:.1f} s"
        _write(cache, settings, extract_seconds=seconds)
    echo(f"[3/6] cache: {cache} {what}, {size / 2**20:.1f} MiB on disk")
    return {"path": str(cache), "bytes_on_disk": size, "extract_seconds": seconds, "noop": bool(summary.get("noop")),
            "samples": summary.get("samples"), "tokens": summary.get("tokens")}


def step_train(out: Path, s: DemoSettings, cache: Path, target: Path, echo) -> dict:
    from dflash.train import checkpoint
    from dflash.train.config import tiny
    from dflash.train.export import export_drafter
    from dflash.train.loop import train
    from dflash.train.model import DFlashDrafter, DrafterConfig

    run_dir, export_dir = out / "run", out / "export"
    settings = {"cache": _read(cache)["settings"], "train": s.train}
    record = _fresh(run_dir, settings)
    if record is None:
        shutil.rmtree(export_dir, ignore_errors=True)
        cfg = tiny().override(cache=str(cache), target=str(target), out=str(run_dir), **s.train)
        t0 = time.perf_counter()
        result = train(cfg)
        seconds = time.perf_counter() - t0
        record = {"seconds": seconds, "steps": result["step"], "eval": result["eval"]}
        _write(run_dir, settings, **record)
        echo(f"[4/6] train: {result['step']} steps in {seconds:.1f} s -> {run_dir}")
    else:
        echo(f"[4/6] train: reusing {run_dir} ({record['steps']} steps, trained in {record['seconds']:.1f} s)")
    if _fresh(export_dir, settings) is None:
        ckpt = checkpoint.resolve(run_dir, "latest")
        state = checkpoint.read_state(ckpt)
        dcfg = DrafterConfig.from_dict(state["drafter_config"])
        drafter = DFlashDrafter(dcfg)
        drafter.load_state_dict(checkpoint.load_weights(ckpt), strict=True)
        import torch

        export_drafter(drafter, dcfg, export_dir, dtype=torch.float32)
        _write(export_dir, settings)
        echo(f"      exported {ckpt} -> {export_dir}")
    return record


def heldout_prompts(tokenizer, chats: list[dict]) -> list[list[int]]:
    """Each held-out chat up to its last user turn, with the assistant generation prompt."""
    prompts = []
    for chat in chats:
        messages = chat["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        ids = tokenizer.apply_chat_template(messages[: last + 1], tokenize=True, add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
        prompts.append(list(ids))
    return prompts


def step_eval(out: Path, s: DemoSettings, heldout: Path, target: Path, echo) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.eval.speculative import evaluate, load_drafter
    from dflash.shared import demo_data, toy

    path = out / "eval.json"
    settings = {"export": _hash_file(out / "export" / "model.safetensors"), "heldout": _hash_file(heldout),
                "max_new_tokens": s.max_new_tokens, "prompts": s.eval_prompts}
    if _fresh(path, settings) is not None and path.is_file():
        result = json.loads(path.read_text())
        echo(f"[5/6] eval: reusing {path}")
        return result
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    drafter, _ = load_drafter(out / "export", dtype=torch.float32)
    prompts = heldout_prompts(tokenizer, demo_data.read_jsonl(heldout))[: s.eval_prompts]
    eos = [tokenizer.convert_tokens_to_ids(toy.IM_END)]
    t0 = time.perf_counter()
    result = evaluate(model, drafter, prompts, max_new_tokens=s.max_new_tokens, eos_token_ids=eos, check=True)
    result["seconds"] = time.perf_counter() - t0
    for row in result["per_prompt"]:
        row["text"] = tokenizer.decode(row["tokens"])
    path.write_text(json.dumps(result, indent=2) + "\n")
    _write(path, settings)
    o = result["overall"]
    echo(f"[5/6] eval: {o['prompts']} prompts, lossless={o['lossless']}, tau {o['tau']:.2f}, "
         f"speedup {o['speedup']:.2f}x ({result['seconds']:.1f} s)")
    return result


def read_metrics(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(records: list[dict], png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, (ax_loss, ax_tau) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    ax_loss.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="held-out loss")
    ax_loss.set_xlabel("step"), ax_loss.set_ylabel("weighted CE"), ax_loss.set_yscale("log"), ax_loss.legend()
    ax_tau.plot([r["step"] for r in evals], [r["tau"] for r in evals], "o-", color="C2",
                label="held-out acceptance length (offline)")
    ax_tau.plot([r["step"] for r in train], [1 + r["acc"] for r in train], color="C3", alpha=0.5,
                label="1 + train top-1 accuracy")
    ax_tau.set_xlabel("step"), ax_tau.set_ylabel("tokens"), ax_tau.legend()
    fig.suptitle("DFlash drafter training (demo)")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


def run_demo(out: str | Path, settings: DemoSettings | None = None, echo=click.echo) -> dict:
    """All six steps; returns (and writes) OUT/summary.json."""
    s = settings or DemoSettings.full()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train_jsonl, heldout = step_data(out, s, echo)
    target, target_record = step_target(out, s, train_jsonl, echo)
    cache = step_extract(out, s, train_jsonl, target, echo)
    trained = step_train(out, s, out / "cache.zarr", target, echo)
    result = step_eval(out, s, heldout, target, echo)

    records = read_metrics(out / "run")
    png = plot_curves(records, out / "training_curves.png")
    offline = trained["eval"]["tau"] if trained.get("eval") else None
    o = result["overall"]
    summary = {
        "out": str(out),
        "settings": dataclasses.asdict(s),
        "target": {"path": str(target), "train_seconds": target_record.get("train_seconds"),
                   "final_loss": target_record.get("final_loss"), "num_params": target_record.get("num_params")},
        "cache": cache,
        "training": {"seconds": trained["seconds"], "steps": trained["steps"], "final_eval": trained.get("eval")},
        "acceptance_offline": offline,
        "acceptance_online": o["tau"],
        "online_vs_offline_rel_diff": abs(o["tau"] - offline) / offline if offline else None,
        "lossless": o["lossless"],
        "speedup": o["speedup"],
        "tokens_per_target_forward": o["tokens_per_target_forward"],
        "tau_histogram": o["tau_histogram"],
        "eval_prompts": o["prompts"],
        "export": str(out / "export"),
        "training_curves": str(png),
        "demo_seconds": time.perf_counter() - t0,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    echo("[6/6] summary")
    echo(f"      cache on disk            {cache['bytes_on_disk'] / 2**20:.2f} MiB "
         f"({cache['samples']} samples, {cache['tokens']} tokens, extracted in {cache['extract_seconds']:.1f} s)")
    echo(f"      target training time     {target_record.get('train_seconds', float('nan')):.1f} s")
    echo(f"      drafter training time    {trained['seconds']:.1f} s ({trained['steps']} steps)")
    echo(f"      acceptance offline       {offline:.3f}  (training's final held-out estimate)"
         if offline is not None else "      acceptance offline       n/a")
    echo(f"      acceptance online        {o['tau']:.3f}  ({o['prompts']} held-out prompts, lossless={o['lossless']})")
    echo(f"      speedup vs greedy        {o['speedup']:.2f}x wall clock, "
         f"{o['tokens_per_target_forward']:.2f} tokens per target forward")
    echo(f"      curves                   {png}")
    echo(f"      this run took            {summary['demo_seconds']:.1f} s")
    return summary


@click.command()
@click.option("--out", "out", default="demo_out", show_default=True, type=click.Path(file_okay=False),
              help="Output folder; every step is reused from it when already built.")
@click.option("--small", is_flag=True, help="Reduced sizes (the test suite's demo, seconds).")
def main(out: str, small: bool) -> None:
    """Run the whole CPU demo: data, target, cache, drafter, speculative eval, summary."""
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    run_demo(out, DemoSettings.small() if small else DemoSettings.full())


if __name__ == "__main__":
    main()
