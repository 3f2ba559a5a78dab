"""Acceptance over a benchmark in minutes: at temperature 0 decoding emits the greedy continuation, so batched
continuations, one target forward, each walked as decoding walks it; ``spec_sample`` checks a few by real decoding."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from dflash.extract.regenerate import GenerationSettings, StaticDecoder, generate_batch, generation_kwargs
from dflash.extract.target import TargetRunner
from dflash.shared.cache import CacheReader
from dflash.train.data import AnchorDataset, Collate, candidate_anchors
from dflash.train.export import check_against_target
from dflash.train.model import DFlashDrafter, TargetHead, load_target_head
from dflash.train.replay import block_predictor, sample_blocks
from dflash.train.replay import replay as replay_decoding

from .speculative import (device_of, evaluate, first_difference, load_drafter, mismatch_message, sync_device,
                          tau_histogram)

ANCHORS_PER_FORWARD = 256  # blocks per drafter forward (dense attention: queries = this x B)
REPEAT_TOKENS = 8  # a block starts in a verbatim repeat where the next this many tokens appeared earlier


def replay_export(cache: str | Path, samples: list[int], export: str | Path, target: str | Path,
                  max_length: int = 4096, max_new_tokens: int | None = None) -> dict[str, Any]:
    """Decoding replayed on cache ``samples`` by a drafter from an export or run folder (``train.replay``'s dict)."""
    drafter, config = load_drafter(export, dtype=torch.float32)
    head = load_target_head(target, "cpu", torch.float32)
    data = AnchorDataset(CacheReader(str(cache)), list(config.target_layer_ids), max_length,
                         max_anchors=max_length, seed=0)
    return replay_decoding(data, samples, block_predictor(drafter, head), Collate(None),
                           max_new_tokens=max_new_tokens).to_dict()


def greedy_continuations(target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         eos_token_ids: Iterable[int] = (), batch_size: int = 16, static: bool | None = None
                         ) -> list[tuple[list[int], bool]]:
    """Per prompt: (greedy tokens before the stop token, truncated?); ``static``: regeneration's
    static KV cache (None: on CUDA)."""
    stops = sorted({int(t) for t in eos_token_ids})
    gen_kwargs = generation_kwargs(GenerationSettings(max_new_tokens=max_new_tokens), stops, stops[0] if stops else 0)
    if not stops:  # generate() refuses an empty eos list
        gen_kwargs["eos_token_id"] = None
    static = device_of(target).type == "cuda" if static is None else static
    decoder = StaticDecoder(target, batch_size, max_new_tokens, max(map(len, prompts))) if static and prompts else None

    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # similar lengths share a batch
    out: dict[int, tuple[list[int], bool]] = {}
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        out.update(zip(rows, generate_batch(target, [prompts[i] for i in rows], gen_kwargs, stops, decoder)))
    return [out[i] for i in range(len(prompts))]


def replay_samples(runner, prompts: Sequence[Sequence[int]], continuations: Sequence[tuple[list[int], bool]],
                   stops: frozenset[int]) -> list[dict[str, Any]]:
    """One batched target forward over prompt + continuation -> per prompt the replay's sample, and
    ``disagreements``: positions where the forward's greedy token is not the generated one (0 in float32)."""
    sequences = [torch.tensor(list(p) + tokens, dtype=torch.long) for p, (tokens, _) in zip(prompts, continuations)]
    out = runner.forward(*runner.pad_batch(sequences))
    hidden = out.hidden.flatten(1).split([len(s) for s in sequences])  # per prompt (T, n * D)
    top1 = out.topk_ids[:, 0].long().split([len(s) for s in sequences])
    samples = []
    for prompt, (tokens, truncated), ids, h, t1 in zip(prompts, continuations, sequences, hidden, top1):
        ids, P = ids.to(t1.device), len(prompt)
        if not truncated:
            stop = int(t1[-1])  # a stop the forward does not pick (a bf16 near-tie): the smallest stop id
            ids = torch.cat([ids, ids.new_tensor([stop if stop in stops else min(stops)])])
            h = torch.cat([h, h.new_zeros(1, h.shape[1])])
            t1 = torch.cat([t1, t1[-1:]])
        samples.append({"input_ids": ids, "loss_mask": torch.arange(len(ids), device=ids.device) >= P,
                        "context_hidden": h, "target_top1": t1, "disagreements": int((t1[P - 1:-1] != ids[P:]).sum())})
    return samples


def score_sample(sample: dict[str, Any], predict, device) -> list[int]:
    """The block taus greedy speculative decoding takes on one replay sample."""
    tensors = {k: v for k, v in sample.items() if isinstance(v, torch.Tensor)}
    items = [{**tensors, "anchors": part, "block_valid": torch.ones(len(part), dtype=torch.bool)}
             for part in candidate_anchors(tensors["loss_mask"].cpu()).split(ANCHORS_PER_FORWARD)]
    return sample_blocks(items, predict, Collate(None), device)[0]


@torch.inference_mode()
def replay_benchmark(target, drafter: DFlashDrafter, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                     eos_token_ids: Iterable[int] = (), batch_size: int = 16, progress: bool = False) -> dict[str, Any]:
    """Greedy speculative decoding replayed on every prompt: {"summary", "per_prompt", "seconds"}."""
    config = drafter.config
    check_against_target(config, target)
    device, stops = device_of(target), frozenset(int(t) for t in eos_token_ids)
    head = TargetHead(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    predict = block_predictor(drafter.eval(), head)
    seconds = {"generate": 0.0, "forward": 0.0, "drafter": 0.0}

    @contextlib.contextmanager
    def clock(key):
        start = time.perf_counter()
        yield
        sync_device(device)
        seconds[key] += time.perf_counter() - start

    with clock("generate"):
        continuations = greedy_continuations(target, prompts, max_new_tokens, stops, batch_size)
    records: list[dict[str, Any]] = [{}] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]) - len(continuations[i][0]))
    with contextlib.closing(TargetRunner(target, list(config.target_layer_ids), topk=1)) as runner:
        for first in tqdm(range(0, len(order), batch_size), desc="replay", unit="batch", disable=not progress):
            rows = order[first:first + batch_size]
            with clock("forward"):
                samples = replay_samples(runner, [prompts[i] for i in rows], [continuations[i] for i in rows], stops)
            with clock("drafter"):
                for i, sample in zip(rows, samples):
                    taus = score_sample(sample, predict, device)
                    tokens = sample["input_ids"][len(prompts[i]):].tolist()
                    records[i] = {"index": i, "prompt_tokens": len(prompts[i]), "new_tokens": len(tokens),
                                  "truncated": continuations[i][1], "blocks": len(taus),
                                  "tau": sum(taus) / len(taus) if taus else math.nan,
                                  "block_taus": taus, "disagreements": sample["disagreements"], "tokens": tokens}
    taus = [t for r in records for t in r["block_taus"]]
    summary = {"prompts": len(records), "new_tokens": sum(r["new_tokens"] for r in records),
               "drafted_tokens": sum(taus), "blocks": len(taus), "tau": sum(taus) / len(taus) if taus else math.nan,
               "tau_histogram": tau_histogram(taus, config.block_size),
               "truncated": sum(r["truncated"] for r in records),
               "disagreements": sum(r["disagreements"] for r in records), **repeat_split(records)}
    return {"summary": summary, "per_prompt": records, "seconds": seconds}


def repeat_split(records: Iterable[dict[str, Any]], n: int = REPEAT_TOKENS) -> dict[str, Any]:
    """Mean tau of the blocks that start in a verbatim repeat (the next ``n`` tokens appeared earlier in the
    continuation: a drafter that copies takes all of it) and of the others: how much of a low tau is copying."""
    taus: dict[bool, list[int]] = {True: [], False: []}
    for r in records:
        tokens, seen, repeats, position = r["tokens"], set(), [], 0
        for i in range(len(tokens) - n + 1):
            repeats.append(tuple(tokens[i:i + n]) in seen)
            seen.add(tuple(tokens[i:i + n]))
        for tau in r["block_taus"]:
            taus[position < len(repeats) and repeats[position]].append(tau)
            position += tau
    means = {key: sum(values) / len(values) if values else math.nan for key, values in taus.items()}
    return {"tau_in_repeats": means[True], "blocks_in_repeats": len(taus[True]), "tau_elsewhere": means[False]}


def sample_indices(n: int, k: int) -> list[int]:  # k indices spread evenly over n (all when k >= n)
    return list(range(n)) if k >= n else sorted({int(i * n / k) for i in range(k)})


def first_divergence(replay_taus: Sequence[int], online_taus: Sequence[int]) -> str | None:
    if list(replay_taus) == list(online_taus):
        return None
    i = first_difference(replay_taus, online_taus)
    return (f"block {i} (after {sum(online_taus[:i])} drafted tokens): replay tau {list(replay_taus[i:i + 5])}..., "
            f"online {list(online_taus[i:i + 5])}...; blocks {len(replay_taus)} vs {len(online_taus)}")


def spec_sample(target, drafter: DFlashDrafter, prompts: Sequence[Sequence[int]], replay: dict[str, Any], k: int, *,
                max_new_tokens: int, eos_token_ids: Iterable[int] = (), warmup: bool = True,
                progress: bool = False, session=None) -> dict[str, Any]:
    """``evaluate`` on ``k`` of the prompts, each row's "divergence" from its replay: None, or where they part."""
    indices = sample_indices(len(prompts), k)
    result = evaluate(target, drafter, [prompts[i] for i in indices], max_new_tokens=max_new_tokens,
                      eos_token_ids=eos_token_ids, check=False, warmup=warmup, progress=progress, session=session)
    for row, i in zip(result["per_prompt"], indices):
        replayed = replay["per_prompt"][i]
        row.update(index=i, replay_tau=replayed["tau"], tokens_equal=row["tokens"] == replayed["tokens"],
                   taus_equal=row["block_taus"] == replayed["block_taus"])
        taus = first_divergence(replayed["block_taus"], row["block_taus"])
        row["divergence"] = (mismatch_message(row["tokens"], replayed["tokens"], row["greedy_margins"],
                                              where=f"prompt {i}: online vs batched")
                             or (taus and f"prompt {i}: {taus}"))
    result["indices"] = indices
    return result


def benchmark_line(name: str, replay: dict[str, Any], sample: dict[str, Any] | None) -> dict[str, Any]:
    """One benchmark's report row: replay over all prompts, online figures over the sample."""
    s = replay["summary"]
    row = {"benchmark": name, "prompts": s["prompts"], "new_tokens": s["new_tokens"], "tau": s["tau"],
           "blocks": s["blocks"], "tau_histogram": s["tau_histogram"], "sample_prompts": 0,
           **{k: s[k] for k in ("tau_in_repeats", "blocks_in_repeats", "tau_elsewhere")},
           "online_tau": math.nan, "greedy_tokens_per_s": math.nan, "spec_tokens_per_s": math.nan,
           "speedup": math.nan, "lossless": None, "ties": None, "replay_equal": None, "block_in_greedy_steps": {}}
    if sample and sample["per_prompt"]:
        o, rows = sample["overall"], sample["per_prompt"]
        row.update(sample_prompts=len(rows), online_tau=o["tau"], greedy_tokens_per_s=o["greedy_tokens_per_s"],
                   spec_tokens_per_s=o["spec_tokens_per_s"], speedup=o["speedup"],
                   block_in_greedy_steps=o["block_in_greedy_steps"],
                   lossless=sum(r["lossless"] for r in rows), ties=sum(r["tie"] for r in rows),
                   replay_equal=sum(r["tokens_equal"] and r["taus_equal"] for r in rows))
    block = sum(row["block_in_greedy_steps"].values())  # every prompt's tau at the sample's cost: a steadier speedup
    row["speedup_at_replay_tau"] = row["tau"] / block if block else math.nan
    return row


def fmt(value, spec: str = ".2f") -> str:  # "-" for a figure not measured (None or NaN)
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_benchmarks(lines: Iterable[dict[str, Any]], markdown: bool = False) -> str:
    """``benchmark_line`` rows as dflash-eval prints them (with the sample's checks and the replay's tau
    histograms), or as ``make demo-real``'s markdown table."""
    lines = list(lines)
    if markdown:
        out = ["| benchmark | prompts | tokens | tau (replay) | tau (online sample) | greedy tok/s | speculative tok/s "
               "| speedup | a block, in greedy steps | speedup at replay tau |", "|" + " --- |" * 10]
        for r in lines:
            speedup, at_tau = (fmt(v) + "x" * (fmt(v) != "-") for v in (r["speedup"], r["speedup_at_replay_tau"]))
            out.append(f"| {r['benchmark']} | {r['prompts']} | {r['new_tokens']} | {fmt(r['tau'])} | "
                       f"{fmt(r['online_tau'])} | {fmt(r['greedy_tokens_per_s'], '.0f')} | "
                       f"{fmt(r['spec_tokens_per_s'], '.0f')} | {speedup} | "
                       f"{fmt(sum(r['block_in_greedy_steps'].values()) or None)} | {at_tau} |")
        return "\n".join(out)
    head = (f"{'benchmark':<16} {'prompts':>7} {'tokens':>8} {'tau':>6} {'sample':>6} {'online tau':>10} "
            f"{'greedy tok/s':>12} {'spec tok/s':>10} {'speedup':>7} {'lossless':>13} {'= replay':>8}")
    out = [head, "-" * len(head)]
    for r in lines:
        k = r["sample_prompts"]
        lossless = (f"{r['lossless']}/{k}" + (f" +{r['ties']} tie" if r.get("ties") else "")) if k else "-"
        equal = f"{r['replay_equal']}/{k}" if k else "-"
        out.append(f"{r['benchmark']:<16} {r['prompts']:>7} {r['new_tokens']:>8} {fmt(r['tau']):>6} {k:>6} "
                   f"{fmt(r['online_tau']):>10} {fmt(r['greedy_tokens_per_s'], '.1f'):>12} "
                   f"{fmt(r['spec_tokens_per_s'], '.1f'):>10} {fmt(r['speedup']):>6}x {lossless:>13} {equal:>8}")
    out.append(f"tau in verbatim repeats (the next {REPEAT_TOKENS} tokens seen before) / elsewhere, replay:")
    out += [f"  {r['benchmark']:<16} {fmt(r['tau_in_repeats'])} ({r['blocks_in_repeats']} blocks) / "
            f"{fmt(r['tau_elsewhere'])}" for r in lines]
    if timed := [r for r in lines if r["block_in_greedy_steps"]]:
        out.append("a speculative block's time in greedy steps (the sample; prefill spread over its blocks):")
        for r in timed:
            steps = r["block_in_greedy_steps"]
            out.append(f"  {r['benchmark']:<16} " + ", ".join(f"{part} {fmt(v)}" for part, v in steps.items())
                       + f"; whole block {fmt(sum(steps.values()))}, so replay tau runs at "
                       f"{fmt(r['speedup_at_replay_tau'])}x")
    out.append("tau histogram (blocks accepting 1..B tokens, replay):")
    out += [f"  {r['benchmark']:<16} " + " ".join(f"{k}:{n}" for k, n in enumerate(r["tau_histogram"], start=1))
            for r in lines]
    return "\n".join(out)
