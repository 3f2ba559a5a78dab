"""DFlash speculative decoding at temperature 0, one prompt at a time: the drafter proposes a block, one target forward
accepts its longest greedy prefix plus a bonus token; the output must equal greedy's but at a tie (``TIE_ULPS``)."""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import StaticCache

from dflash.train import checkpoint
from dflash.train.export import CONFIG_NAME, check_against_target, load_exported
from dflash.train.model import DFlashDrafter, DrafterConfig

from . import fused_drafter as fused

log = logging.getLogger(__name__)

TIE_ULPS = 2  # top-1 and top-2 logits this many units in the last place apart (or closer) are a tie


class LosslessError(RuntimeError):
    """Speculative output differs from plain greedy output at temperature 0."""


class DFlashProposer:
    """A DFlashDrafter with the target's embedding and LM head. Its context keys/values stay in buffers of
    ``capacity`` positions until ``reset``; a block computes the positions new since the last (a window of B; a
    prompt's at once) and masks the rest, so every block has one shape and on CUDA (``capture``) a proposal is one
    CUDA graph. The weights are taken once, as the graph reads them at their addresses."""

    def __init__(self, drafter: DFlashDrafter, target, capacity: int, capture: bool = False):
        self.drafter, self.config = drafter.eval(), drafter.config
        c, B, device = self.config, self.config.block_size, drafter.fc.weight.device
        self.block_size, self.target_layer_ids = B, list(c.target_layer_ids)
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        check_against_target(c, target)
        if capacity + B > c.max_position_embeddings:
            raise ValueError(f"{capacity} positions and a block of {B} run past the drafter's "
                             f"max_position_embeddings={c.max_position_embeddings}")
        self._weights = fused.DecodingWeights.of(self.drafter)
        shape = (c.num_hidden_layers, 1, c.num_key_value_heads, capacity + B, c.head_dim)
        self._keys, self._values = (torch.zeros(shape, dtype=self._weights.dtype, device=device) for _ in range(2))
        self._window = torch.zeros(1, B, c.num_context_layers * c.hidden_size, dtype=self._weights.dtype, device=device)
        self._start, self._ctx_len, self._position, self._anchor = (
            torch.zeros((), dtype=torch.long, device=device) for _ in range(4))
        self._masks = torch.full((1, B - 1), c.mask_token_id, dtype=torch.long, device=device)
        self._graph, self._out, self._runs, self._capture = None, None, 0, capture and device.type == "cuda"
        self._context_len = 0

    def reset(self) -> None:
        """Forget the kept context (a new sequence)."""
        self._context_len = 0

    def propose(self, context: torch.Tensor, tokens: Sequence[int], position: int) -> torch.Tensor:
        """(B - 1,) proposals after ``position`` from context (1, position, n * D) and the tokens so far."""
        return self.block_logits(context, tokens, position).argmax(dim=-1)

    @torch.inference_mode()
    def block_logits(self, context: torch.Tensor, tokens: Sequence[int], position: int) -> torch.Tensor:
        """(B - 1, V) drafter logits (``propose``'s arguments); the context extends the kept one."""
        B, ctx_len, kept = self.block_size, context.shape[1], self._context_len
        if ctx_len < kept or ctx_len + B > self._keys.shape[3]:
            raise ValueError(f"context of {ctx_len} positions after {kept} kept; the buffers hold "
                             f"{self._keys.shape[3] - B}")
        if ctx_len - kept > B:  # a prompt: its positions at once, outside the graph
            positions = torch.arange(kept, ctx_len, device=context.device).unsqueeze(0)  # (1, new)
            keys, values = fused.context_kv(self.drafter, self._weights, context[:, kept:ctx_len], positions)
            self._keys[:, :, :, kept:ctx_len], self._values[:, :, :, kept:ctx_len] = keys, values
            kept = ctx_len
        self._window[:, :ctx_len - kept] = context[:, kept:ctx_len]
        self._start.fill_(kept), self._ctx_len.fill_(ctx_len), self._position.fill_(position)
        self._anchor.fill_(int(tokens[-1]))
        self._context_len = ctx_len
        return self._step()

    def _step(self) -> torch.Tensor:
        if not self._capture:
            return self._run()
        self._runs += 1
        if self._graph is None and self._runs <= 3:  # warm-up on a side stream, as capture wants
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self._run()
            torch.cuda.current_stream().wait_stream(side)
            return out
        if self._graph is None:
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._out = self._run()
        self._graph.replay()
        return self._out.clone()  # the next replay writes there again

    def _run(self) -> torch.Tensor:  # (B - 1, V) logits from the static inputs
        B, device = self.block_size, self._keys.device
        new = self._start + torch.arange(B, device=device)
        keys, values = fused.context_kv(self.drafter, self._weights, self._window, new.unsqueeze(0))
        self._keys.index_copy_(3, new, keys)
        self._values.index_copy_(3, new, values)
        valid = torch.arange(self._keys.shape[3], device=device) < self._ctx_len
        block_ids = torch.cat([self._anchor.view(1, 1), self._masks], dim=1)
        block_positions = (self._position + torch.arange(B, device=device)).unsqueeze(0)
        hidden = fused.block_forward(self.drafter, self._weights, self.embed(block_ids), block_positions,
                                     (self._keys, self._values), valid)
        return self.lm_head(hidden[0, 1:].to(self.lm_head.weight.dtype))


def load_drafter(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
                 ) -> tuple[DFlashDrafter, DrafterConfig]:
    """Load a drafter from an export folder, a checkpoint folder, or a run folder (latest checkpoint)."""
    path = Path(path)  # a run folder holds a config.json too: checkpoints first
    ckpt = path if (path / "state.json").is_file() and (path / "model.safetensors").is_file() \
        else checkpoint.resolve(path, "latest")
    if ckpt is None:
        if not (path / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{path}: neither an export folder (config.json) nor a run with checkpoints")
        drafter, config = load_exported(path, device=device, dtype=dtype)
        return drafter.eval(), config
    drafter, state = checkpoint.load_drafter(ckpt)
    log.info("drafter from checkpoint %s (step %s)", ckpt, state.get("step"))
    return drafter.to(device=device, dtype=dtype).eval(), drafter.config


@dataclass
class Generation:
    """One prompt's decode."""

    tokens: list[int]  # generated tokens (eos included when it was hit)
    target_forwards: int  # target forward passes, prefill included
    seconds: float  # wall clock, prefill included
    block_taus: list[int] = field(default_factory=list)  # speculative: tokens each verify emitted (incl. bonus)
    margins: list[float] = field(default_factory=list)  # greedy: top-1 minus top-2 logit per token
    ties: list[bool] = field(default_factory=list)  # greedy: top-2 within TIE_ULPS of top-1 in the logits' dtype
    parts: dict[str, float] = field(default_factory=dict)  # speculative: seconds of prefill, proposal, verify, loop


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _layer_states(hidden_states, layer_ids: Sequence[int] | None) -> torch.Tensor | None:  # (T, n * D), a copy
    return None if layer_ids is None else torch.cat([hidden_states[i + 1][0] for i in layer_ids], dim=-1)


class EagerTarget:
    """The decoding loops' target on one dynamic KV cache (the reference); ``crop`` drops rejected drafts."""

    def __init__(self, target):
        self.target, self.device, self.cache = target, device_of(target), None
        forward_parameters = inspect.signature(type(target).forward).parameters  # "cache": transformers 5.2x
        self._cache_name = "cache" if "cache" in forward_parameters else "past_key_values"

    def reset(self) -> None:
        self.cache = None

    @property
    def length(self) -> int:
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def forward(self, ids: Sequence[int], layer_ids: Sequence[int] | None = None, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``ids`` at the next positions -> (logits (n or 1, V), chosen layers' states (n, n_l * D) or None)."""
        kwargs = {"logits_to_keep": 1} if last_only else {}
        if self.cache is not None:
            kwargs[self._cache_name] = self.cache
        out = self.target(input_ids=torch.tensor([list(ids)], device=self.device), use_cache=True,
                          output_hidden_states=layer_ids is not None, **kwargs)
        caches = (getattr(out, name, None) for name in (self._cache_name, "past_key_values", "cache"))
        self.cache = next(c for c in caches if c is not None)
        return out.logits[0], _layer_states(out.hidden_states, layer_ids)

    def crop(self, keep: int) -> None:  # a crop that left another length: the decoding loop's position check raises
        if keep > self.length:
            raise ValueError(f"cannot crop a {self.length}-position cache to {keep}")
        if keep < self.length:
            self.cache.crop(keep - self.length)  # negative: the positions removed


class StaticTarget(EagerTarget):
    """``EagerTarget`` on one static KV cache; ``capture``: 1- and B-token forwards as CUDA graphs (prefill eager)."""

    length = 0  # positions written, counted here: the static cache keeps rejected drafts until overwritten

    def __init__(self, target, max_length: int, capture: bool = False):
        super().__init__(target)
        self.cache = StaticCache(config=target.config, max_cache_len=max_length)
        self.max_length = max_length
        self._step = torch.compile(self._run, mode="reduce-overhead", dynamic=False) if capture else self._run

    def reset(self) -> None:
        self.cache.reset()
        self.length = 0

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, hidden: bool):
        out = self.target(input_ids=ids, position_ids=positions[None], cache_position=positions, use_cache=True,
                          output_hidden_states=hidden, **{self._cache_name: self.cache})
        return out.logits, out.hidden_states

    def forward(self, ids, layer_ids=None, last_only=False):
        n = len(ids)
        if self.length + n > self.max_length:
            raise ValueError(f"static KV cache of {self.max_length} positions cannot take {self.length + n}")
        positions = torch.arange(self.length, self.length + n, device=self.device)
        run = self._run if self.length == 0 else self._step  # the prefill's length varies: eager
        logits, hidden = run(torch.tensor([list(ids)], device=self.device), positions, layer_ids is not None)
        self.length += n
        return (logits[0, -1:] if last_only else logits[0]).clone(), _layer_states(hidden, layer_ids)

    def crop(self, keep: int) -> None:
        if keep > self.length:
            raise ValueError(f"cannot crop a {self.length}-position cache to {keep}")
        counters = [getattr(layer, "cumulative_length", None) for layer in getattr(self.cache, "layers", ())]
        counters = [c for c in counters if isinstance(c, torch.Tensor)]  # transformers 5.17+: each layer writes there
        if keep < self.length and counters:  # in place (a captured graph reads them at their addresses), one launch
            torch._foreach_sub_(counters, self.length - keep)
        self.length = keep


def _start(target, max_new_tokens: int, eos_token_ids: Iterable[int], session: EagerTarget | None):
    """(device, eos set, session reset, start time) of one decode."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device, session = device_of(target), session or EagerTarget(target)
    session.reset()
    sync_device(device)
    return device, frozenset(int(t) for t in eos_token_ids), session, time.perf_counter()


@torch.inference_mode()
def greedy_generate(target, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_ids: Iterable[int] = (), session: EagerTarget | None = None) -> Generation:
    """Plain greedy decoding, one token per target forward (``session``: default ``EagerTarget``)."""
    device, eos, session, start = _start(target, max_new_tokens, eos_token_ids, session)
    logits, _ = session.forward(prompt_ids, last_only=True)
    tokens, margins, ties, eps = [], [], [], torch.finfo(logits.dtype).eps
    while True:
        first, second = logits[-1].float().topk(2).values.tolist()  # one host sync for both
        tokens.append(int(logits[-1].argmax()))  # as the verify picks: topk may break an exact tie the other way
        margins.append(first - second)
        ties.append(margins[-1] <= TIE_ULPS * eps * abs(first))
        if tokens[-1] in eos or len(tokens) >= max_new_tokens:
            break
        logits, _ = session.forward(tokens[-1:], last_only=True)
    sync_device(device)
    return Generation(tokens, len(tokens), time.perf_counter() - start, margins=margins, ties=ties)


@torch.inference_mode()
def speculative_generate(target, proposer: DFlashProposer, prompt_ids: Sequence[int], max_new_tokens: int,
                         eos_token_ids: Iterable[int] = (), session: EagerTarget | None = None) -> Generation:
    """DFlash speculative decoding at temperature 0 (see the module docstring)."""
    device, eos, session, start = _start(target, max_new_tokens, eos_token_ids, session)
    sequence = [int(t) for t in prompt_ids]  # prompt, then every emitted token
    n_prompt, B, layer_ids = len(sequence), proposer.block_size, list(proposer.target_layer_ids)
    logits, prefill_states = session.forward(sequence, layer_ids, last_only=True)  # states (P, n * D)
    if hasattr(proposer, "reset"):  # a proposer that keeps state between calls starts over
        proposer.reset()
    # Drafter context of positions < p, filled as positions are verified.
    context = prefill_states.new_empty((1, n_prompt + max_new_tokens + B, prefill_states.shape[-1]))
    context[0, :n_prompt] = prefill_states
    sequence.append(int(logits[-1].argmax()))
    # each part timed up to a host sync the loop makes anyway (.tolist()): timing adds none
    parts = {"prefill": time.perf_counter() - start, "proposal": 0.0, "verify": 0.0}
    taus: list[int] = []
    done = sequence[-1] in eos or max_new_tokens <= 1
    while not done:
        p = len(sequence) - 1  # position of the last accepted token, not yet in the cache
        if session.length != p:
            raise RuntimeError(f"KV cache holds {session.length} positions, expected {p}")
        t0 = time.perf_counter()
        drafts = [int(t) for t in proposer.propose(context[:, :p], sequence[:], p).tolist()]  # (B - 1,)
        t1 = time.perf_counter()
        logits, states = session.forward([sequence[-1], *drafts], layer_ids)
        greedy = logits.argmax(dim=-1).tolist()  # the target's tokens for positions p+1 .. p+B
        parts["proposal"] += t1 - t0
        parts["verify"] += time.perf_counter() - t1
        accepted = first_difference(drafts, greedy[:B - 1])
        context[0, p:p + accepted + 1] = states[:accepted + 1]
        session.crop(p + accepted + 1)
        for emitted, token in enumerate(drafts[:accepted] + [greedy[accepted]], start=1):
            sequence.append(token)
            if done := token in eos or len(sequence) - n_prompt >= max_new_tokens:
                break
        taus.append(emitted)
    sync_device(device)
    seconds = time.perf_counter() - start
    parts["loop"] = seconds - sum(parts.values())
    return Generation(sequence[n_prompt:], 1 + len(taus), seconds, block_taus=taus, parts=parts)


def first_difference(a: Sequence, b: Sequence) -> int:
    """Where two sequences first differ (the shorter one's length where one is the other's prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mismatch_message(spec: Sequence[int], greedy: Sequence[int], margins: Sequence[float] = (),
                     where: str = "prompt") -> str | None:
    """None when the two token lists are identical, else what differs and where."""
    if list(spec) == list(greedy):
        return None
    first = first_difference(spec, greedy)
    margin = f"; greedy top-2 logit margin there {margins[first]:.3g}" if first < len(margins) else ""
    return (f"{where}: speculative output differs from greedy at new token {first} "
            f"(speculative {list(spec[first:first + 5])}..., greedy {list(greedy[first:first + 5])}...; "
            f"lengths {len(spec)} vs {len(greedy)}{margin}). A margin near 0 is a numerical tie between a "
            "B-token verify and a 1-token decode (try float32); a clear margin means a decoding bug.")


def tau_histogram(taus: Sequence[int], block_size: int) -> list[int]:
    """counts[k - 1]: blocks that accepted k tokens (a tau outside 1..B is a bookkeeping bug: raised)."""
    if bad := [tau for tau in taus if not 1 <= tau <= block_size]:
        raise ValueError(f"a block emitted {bad[0]} tokens; a block of {block_size} emits 1..{block_size}")
    return [list(taus).count(k) for k in range(1, block_size + 1)]


def _summary(specs: Sequence[Generation], greedies: Sequence[Generation], block_size: int) -> dict[str, Any]:
    new_tokens, taus = sum(len(s.tokens) for s in specs), [t for s in specs for t in s.block_taus]
    spec_s, greedy_s = sum(s.seconds for s in specs), sum(g.seconds for g in greedies)
    spec_fw = sum(s.target_forwards for s in specs)
    return {"new_tokens": new_tokens, "blocks": len(taus), "tau": sum(taus) / len(taus) if taus else math.nan,
            "tau_histogram": tau_histogram(taus, block_size), "target_forwards": spec_fw,
            "greedy_target_forwards": sum(g.target_forwards for g in greedies),
            "tokens_per_target_forward": new_tokens / spec_fw, "spec_seconds": spec_s, "greedy_seconds": greedy_s,
            "spec_tokens_per_s": new_tokens / spec_s if spec_s > 0 else math.nan,
            "greedy_tokens_per_s": new_tokens / greedy_s if greedy_s > 0 else math.nan,
            "speedup": greedy_s / spec_s if spec_s > 0 else math.nan,
            "block_in_greedy_steps": block_parts(specs, greedies, len(taus))}


def block_parts(specs: Sequence[Generation], greedies: Sequence[Generation], blocks: int) -> dict[str, float]:
    """Where a speculative block's time goes (prefill spread over the blocks), in greedy decoding steps."""
    step = sum(g.seconds for g in greedies) / max(sum(len(g.tokens) for g in greedies), 1)
    if not blocks or step <= 0:
        return {}
    return {part: sum(s.parts.get(part, 0.0) for s in specs) / blocks / step
            for part in ("prefill", "proposal", "verify", "loop")}


def captured_decoders(target, drafter: DFlashDrafter, prompts: Sequence[Sequence[int]], max_new_tokens: int
                      ) -> tuple[StaticTarget, DFlashProposer]:
    """``--capture``'s target session and proposer for these prompts, built once for every ``evaluate``."""
    max_length = max(len(p) for p in prompts) + max_new_tokens + 2 * drafter.config.block_size
    cuda = device_of(target).type == "cuda"
    return StaticTarget(target, max_length, capture=cuda), DFlashProposer(drafter, target, max_length, capture=cuda)


def evaluate(target, drafter: DFlashDrafter | DFlashProposer, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int = 128, eos_token_ids: Iterable[int] = (), check: bool = True, warmup: bool = True,
             progress: bool = False, session: StaticTarget | None = None) -> dict[str, Any]:
    """Speculative vs greedy decoding of every prompt: {"overall", "per_prompt", "settings"}; ``check``: a mismatch
    not at a tie raises LosslessError; ``session``: ``--capture``'s, with its proposer (``captured_decoders``)."""
    proposer = drafter
    if isinstance(drafter, DFlashDrafter):  # room for the longest prompt and its new tokens
        proposer = DFlashProposer(drafter, target, max(map(len, prompts), default=0) + max_new_tokens + 1)
    eos, B = sorted({int(t) for t in eos_token_ids}), proposer.block_size
    started = time.perf_counter()
    if warmup and prompts:  # first calls pay for allocator growth, kernels, lazy init, graph capture
        for _ in range(2 if session is not None else 1):
            greedy_generate(target, prompts[0], min(4, max_new_tokens), eos, session)
            speculative_generate(target, proposer, prompts[0], min(2 * B, max_new_tokens), eos, session)
    rows, decodes, warmup_seconds = [], [], time.perf_counter() - started
    for index, prompt in enumerate(tqdm(prompts, desc="dflash-eval", unit="prompt", disable=not progress)):
        greedy = greedy_generate(target, prompt, max_new_tokens, eos, session)
        spec = speculative_generate(target, proposer, prompt, max_new_tokens, eos, session)
        mismatch = mismatch_message(spec.tokens, greedy.tokens, greedy.margins, where=f"prompt {index}")
        first = first_difference(spec.tokens, greedy.tokens)  # a tie: greedy's top two within TIE_ULPS there
        tie = mismatch is not None and first < len(greedy.ties) and greedy.ties[first]
        if check and mismatch is not None and not tie:
            raise LosslessError(mismatch)
        rows.append({"index": index, "prompt_tokens": len(prompt), "lossless": mismatch is None, "mismatch": mismatch,
                     "tie": tie, **_summary([spec], [greedy], B), "block_taus": spec.block_taus, "tokens": spec.tokens,
                     "greedy_margins": greedy.margins[:first + 1]})  # up to where greedy and speculative part
        decodes.append((spec, greedy))
    overall = {"prompts": len(rows), "lossless": all(r["lossless"] or r["tie"] for r in rows),
               "ties": sum(r["tie"] for r in rows)}
    if rows:
        overall.update(_summary(*zip(*decodes), B))
    settings = {"block_size": B, "max_new_tokens": max_new_tokens, "eos_token_ids": eos, "capture": session is not None,
                "target_layer_ids": list(proposer.target_layer_ids), "device": str(device_of(target)),
                "dtype": str(next(target.parameters()).dtype).removeprefix("torch.")}
    return {"overall": overall, "per_prompt": rows, "settings": settings, "warmup_seconds": warmup_seconds}
