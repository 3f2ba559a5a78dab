"""``dflash-cache``: inspect a hidden-state cache (info, show, verify, stats) and convert it. Each command prints a
report, or with ``--json`` one JSON document. Exit: 0 fine, 1 ``verify`` found problems, 2 bad cache or request."""

from __future__ import annotations

import json
import sys

import click

from dflash.shared import inspect as I
from dflash.shared import verify as V
from dflash.shared.cache import CacheError
from dflash.shared.cli import Group, Maybe, validated
from dflash.shared.compression import HIDDEN_CODECS, SCALE_DTYPES, TOPK_DTYPES, size_text
from dflash.shared.convert import ConvertSettings, Interrupted, convert_cache
from dflash.shared.shard_lock import LockError


class CacheCliError(click.ClickException):
    exit_code = 2  # a bad cache or request


def _run(fn, *args, **kwargs) -> dict:
    try:
        return fn(*args, **kwargs)
    except (CacheError, LockError, IndexError) as e:
        raise CacheCliError(str(e)) from e


def _emit_json(doc: dict) -> None:
    click.echo(json.dumps(doc, indent=2, default=str, allow_nan=True))


def _n(x: int | None) -> str:
    return "?" if x is None else f"{x:,}"


def _of(d: dict, key: str) -> str:  # 'committed/planned' of a count
    return f"{_n(d[key])}/{_n(d['planned_' + key])}"


def _skipped(counts: dict[str, int], none: str) -> str:
    return ", ".join(f"{k}={v}" for k, v in counts.items() if v) or none


def _short(h: str | None) -> str:  # a hash's first 12 hex digits, without its 'sha256:' prefix
    return str(h).split(":", 1)[-1][:12] if h else "-"


def _fmt(x: float | None, spec: str = ".1%") -> str:
    return "-" if x is None else format(x, spec)


CACHE = click.argument("cache")
AS_JSON = click.option("--json/--no-json", "as_json", default=False,
                       help="Print one JSON document instead of the report.")
PROGRESS = click.option("--progress/--no-progress", default=True, help="Progress bar on stderr.")


@click.group(cls=Group)
def main():
    """Inspect a dflash hidden-state cache (a Zarr v3 store): CACHE, SRC and DST are local paths or zarr/fsspec URLs."""


def _hidden_per_token(info: dict) -> str:  # hidden-state bytes per token on disk, and their share of raw bf16's
    on_disk, raw = info["bytes_per_token"]["hidden_on_disk"], info["bytes_per_token"]["hidden_raw_bf16"]
    return "-" if on_disk is None else f"{on_disk:,.0f} ({on_disk / raw:.3f} of raw bf16)"


@main.command()
@CACHE
@AS_JSON
def info(cache: str, as_json: bool):
    """Fingerprint, layout, shard states, counts and size on disk of CACHE (a local path or a zarr/fsspec URL)."""
    d = _run(I.cache_info, cache)
    if as_json:
        return _emit_json(d)
    fp, b, e, ch = d["fingerprint"], d["bytes_per_token"], d["encoding"], d["chunks"]
    t, tok, ds, tp = fp["target"], fp["tokenizer"], fp["dataset"], fp["chat_template"]
    eot = f"id {'-' if tp['end_of_turn_id'] is None else tp['end_of_turn_id']}"
    eot = f"{tp['end_of_turn']!r} ({eot}, --end-of-turn)" if tp["end_of_turn"] else f"{eot} (from the template)"
    template = f"from {tp['file']}" if tp["file"] else "the tokenizer's"
    lines = [
        f"cache      {d['path']}  ({d['format']} v{d['format_version']}, "
        f"{'complete' if d['complete'] else 'INCOMPLETE'})",
        f"target     {t['name_or_path']}  rev {t['revision'] or '-'}  dtype {t['dtype'] or '-'}  "
        f"config {_short(t['config_hash'])}  weights {_short(t['weights_hash'])}",
        f"tokenizer  {_short(tok['hash'])}  template {_short(tok['chat_template_hash'])}",
        f"chat       template {_short(tp['hash'])} {template}  kwargs "
        f"{json.dumps(tp['template_kwargs'], sort_keys=True)}  end of turn {eot}  mask {tp['mask_method'] or '-'}",
        f"dataset    {ds['name'] or '-'}  split {ds['split'] or '-'}  rows {_n(ds['rows'])}  hash {_short(ds['hash'])}",
        f"layers     {d['layer_ids']} of {d['num_target_layers']}  ({d['layer_convention']})",
        f"hidden     D={d['hidden_size']} {d['hidden_dtype']}  top-k {d['topk']}  vocab {_n(d['vocab_size'])}  "
        f"max length {d['max_length']} (truncation {d['truncation']})",
        f"codec      hidden {e['hidden']}, top-k log-probs {e['topk_dtype']}; hidden bytes/token: raw bf16 "
        f"{b['hidden_raw_bf16']:,}, encoded {b['hidden_encoded']:,}, on disk {_hidden_per_token(d)}",
        f"chunks     hidden {ch['hidden']}, top-k {ch['topk_ids']}/{ch['topk_logprobs']}, "
        f"input ids {ch['input_ids']}, loss mask {ch['loss_mask']} tokens",
    ]
    record, which = d["converted_from"], "converted"
    while record:  # where a converted cache came from, newest first
        lines.append(f"{which:<10} from {record['path']}  fingerprint {_short(record['fingerprint_digest'])}  "
                     f"(format v{record['format_version']}, hidden {record['hidden']}, top-k log-probs "
                     f"{record['encoding']['topk_dtype']}, hidden chunks {record['chunk_tokens']}, zstd level "
                     f"{record['compression_level']})")
        record, which = record.get("previous"), "  which was"
    lines += ["", f"{'shard':>5}  {'state':<8}  {'samples':>17}  {'tokens':>23}  {'assistant':>11}  {'disk':>11}  "
              "skipped"]
    computed: dict[str, list[str]] = {}  # compute environment -> the shards extracted under it
    for s in d["shards"]:
        lines.append(f"{s['shard_id']:05d}  {s['state']:<8}  {_of(s, 'samples'):>17}  {_of(s, 'tokens'):>23}  "
                     f"{_n(s['assistant_tokens']):>11}  {size_text(s['bytes_on_disk']):>11}  "
                     f"{_skipped(s['skipped'], '-')}")
        c = s.get("compute")
        computed.setdefault(", ".join(f"{k} {v}" for k, v in sorted(c.items())) if c else "unknown", []).append(
            f"{s['shard_id']:05d}")
    lines += [""] * bool(computed) + [
        f"computed   {key}  ({'all shards' if len(computed) == 1 else 'shards ' + ', '.join(ids)})"
        for key, ids in computed.items()]
    lines += [f"writing    shard {s} now: {h['described']}" for s, h in d["writing"].items()]
    ratio = {k: "-" if r is None else f"{r:.2f}x" for k, r in d["compression_ratio"].items()}
    lines += [
        "", f"total      {_of(d, 'samples')} samples, {_of(d, 'tokens')} tokens, {_n(d['assistant_tokens'])} assistant "
        f"tokens ({_fmt(d['assistant_fraction'])}); skipped rows: {_skipped(d['skipped'], 'none')}",
        f"disk       {size_text(d['bytes_on_disk'])}; vs raw bf16: hidden {ratio['hidden']}, "
        f"all arrays {ratio['total']}  (raw {size_text(d['raw_bytes']['total'])})",
    ]
    click.echo("\n".join(lines))


def _tok_text(text: str | None, tid: int) -> str:
    return f"#{tid}" if text is None else repr(text)


@main.command()
@CACHE
@click.argument("index", type=int)
@click.option("--tokenizer", type=Maybe(str), help="Tokenizer folder to decode with (default: the target path "
              "recorded in the cache).")
@click.option("--tokens", type=click.IntRange(min=-1), default=32, help="Rows of the per-token prediction table "
              "(-1: all).")
@click.option("--top", type=click.IntRange(min=0), default=3, help="Target predictions shown per token.")
@click.option("--color/--no-color", default=None, help="ANSI colour for assistant spans (default: when stdout is a "
              "terminal).")
@AS_JSON
def show(cache: str, index: int, tokenizer: str | None, tokens: int, top: int, color: bool | None, as_json: bool):
    """Sample INDEX (global) of CACHE: text with assistant spans marked, target top-k, hidden-state norms."""
    d = _run(I.show_sample, cache, index, tokenizer_path=tokenizer, num_tokens=None if tokens < 0 else tokens, top=top)
    if as_json:
        return _emit_json(d)
    color = sys.stdout.isatty() if color is None else color
    tk = d["tokenizer"]
    note = "" if tk["hash_matches_cache"] in (None, True) else "  WARNING: its hash differs from the cache's"
    texts = [(g["text"] if g["text"] is not None else " ".join(map(str, g["ids"])) + " ", g["assistant"])
             for g in d["segments"]]
    parts = [t if not a else click.style(t, fg="green", bold=True) if color else f"[[{t}]]" for t, a in texts]
    out = [f"sample {d['index']}  (shard {d['shard_id']:05d} sample {d['local_index']}, source row "
           f"{d['source_index']})  length {d['length']}  assistant tokens {d['assistant_tokens']}",
           f"tokenizer {tk['path']}{note}" if tk["loaded"] else f"no tokenizer ({tk['error']}); showing token ids",
           f"--- text (assistant tokens {'in green' if color else 'inside [[ ]]'})", "".join(parts), "---"]
    if d["tokens"]:
        out += [f"target predictions for the next token, first {d['tokens_shown']} of {d['length']} positions "
                f"(A = assistant, * = top-1 is the next token)", f"{'pos':>5} A  {'token':<18} {'next':<18} top-{top}"]
        for t in d["tokens"]:
            nxt = "-" if t["next_id"] is None else _tok_text(t["next_text"], t["next_id"])
            preds = "  ".join(f"{_tok_text(p.get('text'), p['id'])} {p['prob']:.3f}" for p in t["top"])
            out.append(f"{t['pos']:>5} {'A' if t['assistant'] else ' '}{'*' if t['top1_is_next'] else ' '}"
                       f"{_tok_text(t['text'], t['id'])[:18]:<18} {nxt[:18]:<18} {preds}")
    out.append("hidden-state L2 norm per token: " + "  ".join(
        f"layer {n['layer_id']}: mean {n['mean']:.3g} max {n['max']:.3g}"
        for n in d["layer_norms"] if n["mean"] is not None))
    click.echo("\n".join(out))


@main.command()
@CACHE
@click.option("--max-problems", type=click.IntRange(min=0), default=100, help="Problems listed (all are counted).")
@click.option("--workers", type=click.IntRange(min=1), default=4, help="Threads reading and checking chunks.")
@PROGRESS
@AS_JSON
def verify(cache: str, max_problems: int, workers: int, progress: bool, as_json: bool):
    """Read every committed chunk of CACHE and check checksums, values and structure. Exit 1 on any problem."""
    d = _run(V.verify_cache, cache, max_problems=max_problems, progress=progress, workers=workers)
    if as_json:
        _emit_json(d)
    else:
        lines = [f"shard {s['shard_id']:05d}  {s['state']:<8}  committed {_of(s, 'samples')} samples, "
                 f"{_of(s, 'tokens')} tokens" for s in d["shards"]]
        lines.append(f"read {_n(d['chunks_read'])} chunks: {_n(d['samples'])} samples, {_n(d['tokens'])} tokens")
        lines += ["OK: no problems found"] if d["ok"] else [f"{d['num_problems']} problem(s):"] + [
            f"  [{p['check']}] {p['message']}" for p in d["problems"]]
        lines += [f"  ... and {d['problems_left_out']} more (raise --max-problems)"] * bool(d["problems_left_out"])
        click.echo("\n".join(lines))
    sys.exit(0 if d["ok"] else 1)


@main.command()
@CACHE
@click.option("--max-samples", type=click.IntRange(min=1), default=256, help="Samples drawn for activation/top-k "
              "statistics.")
@click.option("--seed", default=0, help="Seed of that draw.")
@click.option("--threshold", type=click.FloatRange(min=0), default=100.0, help="Report the fraction of |x| above this.")
@click.option("--against", type=Maybe(str), help="Cache to measure the hidden states' error against (default: for a "
              "converted cache, its recorded source).")
@AS_JSON
def stats(cache: str, max_samples: int, seed: int, threshold: float, against: str | None, as_json: bool):
    """Length histogram, assistant fraction, per-layer activation and top-k statistics of CACHE."""
    d = _run(I.cache_stats, cache, max_samples=max_samples, seed=seed, threshold=threshold, against=against)
    if as_json:
        return _emit_json(d)
    ln = d["lengths"]
    out = [f"{_n(d['samples'])} samples, {_n(d['tokens'])} tokens, assistant {_fmt(d['assistant_fraction'])}"]
    if ln["histogram"]:
        out.append(f"length: min {ln['min']}  mean {ln['mean']:.1f}  p50 {ln['percentiles']['50']:.0f}  "
                   f"p90 {ln['percentiles']['90']:.0f}  p99 {ln['percentiles']['99']:.0f}  max {ln['max']}  "
                   f"(at max length: {ln['at_max_length']})")
        peak = max(b["count"] for b in ln["histogram"])
        out += [f"  {b['lo']:>6}-{b['hi'] - 1:<6} {b['count']:>9,}  {'#' * round(40 * b['count'] / peak)}"
                for b in ln["histogram"]]
    smp = d["sampled"]
    drawn = "all samples" if smp["indices_all"] else f"seed {smp['seed']}"
    out += [f"activations over {_n(smp['samples'])} samples ({_n(smp['tokens'])} tokens, {drawn}):",
            f"  {'layer':>5} {'mean':>10} {'std':>10} {'rms':>10} {'abs max':>10} {f'|x|>{threshold:g}':>10}"]
    out += [f"  {lay['layer_id']:>5} {lay['mean']:>10.4g} {lay['std']:>10.4g} {lay['rms']:>10.4g} "
            f"{lay['abs_max']:>10.4g} {_fmt(lay['frac_above_threshold']):>10}" for lay in d["activations"]["layers"]]
    tk = d["topk"]
    out.append(f"top-{tk['k']}: mean top-1 prob {_fmt(tk['mean_top1_prob'], '.3f')}, mass in top-k "
               f"{_fmt(tk['mean_topk_mass'], '.3f')}, entropy >= {_fmt(tk['mean_entropy_lower_bound'], '.3f')} nats; "
               f"top-1 = next token {_fmt(tk['top1_is_next_token'])} "
               f"(assistant {_fmt(tk['top1_is_next_token_assistant'])})")
    e = d["conversion_error"]  # a converted cache's error against its source, per layer
    if e is not None and e.get("unavailable"):
        out.append(f"error against the source: {e['unavailable']}")
    elif e is not None:
        note = "" if e["source_matches_record"] in (None, True) else "  (NOT the fingerprint it was converted from)"
        out += [f"error against {e['against']}{note}, over the same {_n(e['tokens'])} tokens:",
                f"  {'layer':>5} {'rel L2':>10} {'max |err|':>10}"]
        out += [f"  {lay['layer_id']:>5} {_fmt(lay['rel_l2'], '.3e'):>10} {lay['max_abs_error']:>10.4g}"
                for lay in e["layers"]]
        tk = e["topk_logprobs"]
        if e["topk_reduced"] or tk["rel_l2"]:
            out.append(f"  top-k log-probs: rel L2 {_fmt(tk['rel_l2'], '.3e')}, max |err| {tk['max_abs_error']:.4g}")
    click.echo("\n".join(out))


@main.command()
@click.argument("src")
@click.argument("dst")
@click.option("--hidden-codec", type=Maybe(click.Choice(HIDDEN_CODECS)), help="Hidden states: 'bf16' lossless, lossy "
              "'fp8' (e4m3, a scale per token and layer), 'int8' or 'int4' (a scale per --hidden-group-size "
              "channels); default: the source's.")
@click.option("--hidden-group-size", type=Maybe(click.IntRange(min=1)), help="Channels sharing one scale under "
              "int8/int4 (must divide the hidden size; even for int4); default: the source's, else 128.")
@click.option("--hidden-scale-dtype", type=Maybe(click.Choice(SCALE_DTYPES)), help="dtype of the lossy codecs' scales "
              "(default: the source's, else float16).")
@click.option("--topk-dtype", type=Maybe(click.Choice(TOPK_DTYPES)), help="Precision of the stored top-k log-probs "
              "(default: the source's).")
@click.option("--chunk-tokens", type=Maybe(click.IntRange(min=1)), help="Tokens per chunk of the converted hidden "
              "states (default: the source's); the small arrays are chunked coarsely.")
@click.option("--compression-level", type=Maybe(int), help="zstd level of the converted cache: 1, 3, 5, ..., 15 "
              "(default: the source's).")
@click.option("--commit-seconds", type=click.FloatRange(min=0), default=10.0, help="Seconds between commits of a "
              "shard (a crash loses at most this much work); 0 = after every read.")
@PROGRESS
@AS_JSON
def convert(src: str, dst: str, progress: bool, as_json: bool, **values):
    """Re-encode the finished cache SRC into DST (another hidden codec, top-k precision, chunking or zstd level).

    No target needed. Same samples, plan and checksums as extraction writes; rerun the same
    command after a crash to resume; `stats DST` then shows the error against the source.
    Exit 2 for a source that is not finished or a DST that holds another cache; Ctrl-C commits
    and stops (exit 130).
    """
    settings = validated(ConvertSettings(**values))
    try:
        d = _run(convert_cache, src, dst, settings, progress=progress)
    except Interrupted as e:
        click.echo(f"dflash-cache convert: interrupted: {e}; rerun the same command to resume", err=True)
        sys.exit(130)  # as a shell reports a process stopped by SIGINT
    before, after = _run(I.cache_info, src), _run(I.cache_info, dst)
    for key in ("bytes_on_disk", "bytes_per_token", "compression_ratio", "encoding"):
        d[key] = {"source": before[key], "destination": after[key]}
    if as_json:
        return _emit_json(d)
    rate = "" if d["tokens_per_s"] is None else f", {d['tokens_per_s']:,.0f} tok/s"
    click.echo("\n".join([
        f"converted  {d['source']} -> {d['destination']}: {d['shards']} shard(s), {_n(d['samples'])} samples, "
        f"{_n(d['tokens'])} tokens ({_n(d['tokens_converted'])} now, {_n(d['tokens_found_done'])} found done) "
        f"in {d['seconds']:.1f} s{rate}",
        f"encoding   hidden {before['encoding']['hidden']} -> {after['encoding']['hidden']}; top-k log-probs "
        f"{before['encoding']['topk_dtype']} -> {after['encoding']['topk_dtype']}",
        f"disk       {size_text(before['bytes_on_disk'])} -> {size_text(after['bytes_on_disk'])}; hidden bytes/token "
        f"{_hidden_per_token(before)} -> {_hidden_per_token(after)}",
        f"next       dflash-cache stats {dst}   (the relative L2 error per layer against the source)",
    ]))


if __name__ == "__main__":
    main()
