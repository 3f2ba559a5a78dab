"""Online evaluation: real DFlash speculative decoding against the target's own greedy
decoding, one prompt at a time (batch size 1).

Speculative loop (temperature 0):

    prefill(prompt)              -> KV cache for 0..P-1, chosen layers' hidden states
                                    for 0..P-1, first token t0 = target argmax
    repeat, with the last accepted token at position p (not yet in the KV cache):
      drafter block  = [last, MASK x (B-1)] at positions p..p+B-1, context = target
                       hidden states of positions < p (fused by the drafter's fc)
      proposals      = drafter argmax of slots 1..B-1 (slot k guesses position p+k)
      verify         = ONE target forward of [last, proposals] on the KV cache;
                       logits row i is the target's greedy token for position p+i+1
      accept         = the longest prefix of proposals equal to those greedy tokens
                       (a of them) plus the target's bonus token: tau = a + 1 tokens
                       emitted, fewer when an eos token or max_new_tokens comes first
                       (tokens verified past the stop are not output, so not counted)
      bookkeeping    = crop the KV cache to p + a + 1 entries (last + accepted drafts),
                       append those positions' hidden states to the drafter context;
                       the bonus token becomes the next block's anchor
    until max_new_tokens or an eos token.

Every emitted token is a target argmax computed on exactly the accepted prefix, so the
output must equal plain greedy decoding token for token; ``evaluate`` checks that and
raises ``LosslessError`` otherwise. The check is exact only up to floating point: a
B-token verify forward and a 1-token decode forward need not round identically, so on
near-ties (bf16 especially) the error reports the greedy top-2 logit margin at the
divergence to tell a numerical tie from a bookkeeping bug. A divergence at a tie (top two
within ``TIE_ULPS`` in the logits' dtype) is counted as one ("tie"), not raised.

``evaluate(target, drafter, prompts, ...) -> dict`` is the whole API a test needs; the
drafter is a ``DFlashDrafter`` or anything with the ``Proposer`` interface.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from dflash.train import attention
from dflash.train.export import check_against_target
from dflash.train.model import DFlashDrafter, DrafterConfig

from . import fused_drafter as fused

log = logging.getLogger(__name__)

TIE_ULPS = 2
"""Top-1 and top-2 logits this many units in the last place apart (or closer) are a tie: on the
H200 in bf16 every sampled prompt's first divergence from greedy had margin 0 (BENCHMARKS.md)."""


class LosslessError(RuntimeError):
    """Speculative output differs from plain greedy output at temperature 0."""


# ---------------------------------------------------------------------------- drafter side


class Proposer(Protocol):
    """What the speculative loop asks of a drafter."""

    block_size: int  # B: anchor + B - 1 proposals per block
    target_layer_ids: list[int]  # target layers whose hidden states form the context

    def propose(self, context: torch.Tensor, tokens: Sequence[int], position: int) -> torch.Tensor:
        """(B - 1,) long proposals for positions position+1 .. position+B-1.

        context: (1, position, n * D) target hidden states of positions < position;
        tokens: every token so far (prompt + generated), tokens[-1] sits at ``position``.
        Within one sequence each call's context extends the previous call's; a proposer
        that keeps state between calls may have a ``reset()``, called before each sequence.
        """


class DFlashProposer:
    """A DFlashDrafter plus the target's own (frozen) embedding and LM head.

    Incremental by default: every drafter layer's context keys and values depend on their
    own position only, and decoding only ever appends verified positions, so each call
    computes them for the new positions alone and keeps them, through the fused decoding
    path of ``fused_drafter``; ``reset`` starts a new sequence. ``incremental=False``
    recomputes the whole context with the training forward every call (the reference the
    incremental path is tested against). ``compile_backend``
    (incremental only): the block's forward compiled by that ``torch.compile`` backend, with
    the context length dynamic (it grows every block), so one graph serves a whole run.
    """

    def __init__(self, drafter: DFlashDrafter, target, config: DrafterConfig | None = None,
                 incremental: bool = True, compile_backend: str | None = None):
        self.drafter = drafter.eval()
        self._block = (torch.compile(fused.block_forward, backend=compile_backend, dynamic=True)
                       if compile_backend else fused.block_forward)
        self.config = config or drafter.config
        self.block_size = self.config.block_size
        self.target_layer_ids = list(self.config.target_layer_ids)
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.incremental = incremental
        check_against_target(self.config, target)
        self.reset()

    def reset(self) -> None:
        """Forget the kept context (the next call starts a new sequence) and take the drafter's
        weights afresh (the fused path holds copies)."""
        self._weights = fused.DecodingWeights.of(self.drafter)
        self._keys: torch.Tensor | None = None  # (L, 1, Hkv, capacity, hd), positions < _context_len valid
        self._values: torch.Tensor | None = None
        self._context_len = 0
        self._last_row: torch.Tensor | None = None  # features of the last kept position

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, tokens: Sequence[int], position: int) -> torch.Tensor:
        return self._block_logits(context, tokens, position).argmax(dim=-1)

    @torch.inference_mode()
    def block_logits(self, context: torch.Tensor, tokens: Sequence[int], position: int) -> torch.Tensor:
        """(B - 1, V) drafter logits for positions position+1 .. position+B-1 (``propose``'s arguments)."""
        return self._block_logits(context, tokens, position)

    def _block_logits(self, context: torch.Tensor, tokens: Sequence[int], position: int) -> torch.Tensor:
        B, device = self.block_size, context.device
        if position + B > self.config.max_position_embeddings:
            raise ValueError(f"block at position {position} runs past the drafter's "
                             f"max_position_embeddings={self.config.max_position_embeddings}")
        block_ids = torch.tensor([[tokens[-1]] + [self.config.mask_token_id] * (B - 1)], device=device)  # (1, B)
        block_positions = torch.arange(position, position + B, device=device).unsqueeze(0)  # (1, B)
        block_embeds = self.embed(block_ids)  # the target's own module: some scale their embeddings
        if self.incremental:
            hidden = self._block(self.drafter, self._weights, block_embeds, block_positions, self._extend(context))
        else:
            hidden = self._full_forward(context, block_embeds, block_positions, position)
        return self.lm_head(hidden[0, 1:].to(self.lm_head.weight.dtype))  # (B-1, V)

    def _extend(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's context keys/values for all of ``context``, (L, 1, Hkv, S, hd) each,
        computing only positions not kept yet.

        The kept positions are reused only while ``context`` still holds them: a shorter
        context, or another feature row at the last kept position (a new sequence without
        ``reset``; that row depends on every earlier token), starts over. They are kept in
        buffers that grow by doubling, so a call writes only its new positions.
        """
        ctx_len, kept = context.shape[1], self._context_len
        if kept and (ctx_len < kept or not torch.equal(context[0, kept - 1], self._last_row)):
            kept = self._context_len = 0
        if ctx_len > kept:
            positions = torch.arange(kept, ctx_len, device=context.device).unsqueeze(0)  # (1, new)
            keys, values = fused.context_kv(self.drafter, self._weights, context[:, kept:], positions)
            if self._keys is None or self._keys.shape[3] < ctx_len:
                self._grow(keys, max(2 * ctx_len, 256))
            self._keys[:, :, :, kept:ctx_len] = keys
            self._values[:, :, :, kept:ctx_len] = values
            self._last_row = context[0, ctx_len - 1].clone()
        elif self._keys is None:  # an empty context: nothing to attend to but the block
            c = self.config
            self._grow(torch.empty(c.num_hidden_layers, 1, c.num_key_value_heads, 0, c.head_dim,
                                   dtype=self._weights.dtype, device=context.device), 256)
        self._context_len = ctx_len
        return self._keys[:, :, :, :ctx_len], self._values[:, :, :, :ctx_len]

    def _grow(self, like: torch.Tensor, capacity: int) -> None:
        """Buffers of ``capacity`` positions shaped like ``like`` (L, 1, Hkv, *, hd), holding the kept positions."""
        shape = (*like.shape[:3], capacity, like.shape[4])
        keys, values = like.new_empty(shape), like.new_empty(shape)
        if self._keys is not None and self._context_len:
            keys[:, :, :, :self._context_len] = self._keys[:, :, :, :self._context_len]
            values[:, :, :, :self._context_len] = self._values[:, :, :, :self._context_len]
        self._keys, self._values = keys, values

    def _full_forward(self, context, block_embeds, block_positions, position: int) -> torch.Tensor:
        B, device, ctx_len = self.block_size, context.device, context.shape[1]
        context_positions = torch.arange(ctx_len, device=device).unsqueeze(0)  # (1, S)
        mask = attention.build_mask(
            "dense",
            anchors=torch.tensor([[position]], device=device),
            block_valid=torch.ones(1, 1, dtype=torch.bool, device=device),
            ctx_len=torch.tensor([ctx_len], device=device),
            context_len=ctx_len,
            block_size=B,
        )
        return self.drafter(context, context_positions, block_embeds, block_positions, mask)  # (1, B, D)


def load_drafter(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
                 ) -> tuple[DFlashDrafter, DrafterConfig]:
    """Load a drafter from an export folder, a checkpoint folder, or a run folder (latest checkpoint)."""
    from dflash.train import checkpoint
    from dflash.train.export import CONFIG_NAME, load_exported

    path = Path(path)
    # a run folder holds a config.json too (the training config): look for checkpoints first
    ckpt = path if (path / "state.json").is_file() and (path / "model.safetensors").is_file() \
        else checkpoint.resolve(path, "latest")
    if ckpt is None and (path / CONFIG_NAME).is_file():
        drafter, config = load_exported(path, device=device, dtype=dtype)
        return drafter.eval(), config
    if ckpt is None:
        raise FileNotFoundError(f"{path}: neither an export folder (config.json) nor a run with checkpoints")
    state = checkpoint.read_state(ckpt)
    if "drafter_config" not in state:
        raise ValueError(f"{ckpt}/state.json has no drafter_config")
    config = DrafterConfig.from_dict(state["drafter_config"])
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(checkpoint.load_weights(ckpt), strict=True)
    drafter = drafter.to(device=device, dtype=dtype) if dtype is not None else drafter.to(device)
    log.info("drafter from checkpoint %s (step %s)", ckpt, state.get("step"))
    return drafter.eval(), config


# ---------------------------------------------------------------------------- KV cache


def cache_length(cache) -> int:
    """Number of cached positions (DynamicCache, or a legacy tuple of (k, v) per layer)."""
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    return int(cache[0][0].shape[-2])


def crop_cache(cache, keep: int):
    """Cut the KV cache down to its first ``keep`` positions and return it.

    ``DynamicCache.crop`` changed meaning across transformers versions: up to early 5.x
    ``crop(max_length)`` keeps max_length tokens (a negative value removes that many);
    in 5.2x ``crop(tokens_to_remove)`` accepts only negative values. ``crop(-n)`` with
    n > 0 means "remove n" in both, and ``crop(0)`` would wipe the old one, so it is
    never called with 0. The result is checked; on any surprise the layers are sliced
    by hand (``layers[i].keys`` in 5.x, ``key_cache`` lists before).
    """
    current = cache_length(cache)
    if keep > current:
        raise ValueError(f"cannot crop a {current}-position cache to {keep}")
    if keep == current:
        return cache
    if isinstance(cache, tuple):  # legacy format: rebuild
        return tuple((k[..., :keep, :], v[..., :keep, :]) for k, v in cache)
    try:
        cache.crop(-(current - keep))
    except (ValueError, RuntimeError, TypeError, AttributeError) as err:
        log.debug("DynamicCache.crop(-%d) failed (%s); slicing by hand", current - keep, err)
    if cache_length(cache) != keep:
        _slice_cache(cache, keep)
    if cache_length(cache) != keep:
        raise RuntimeError(f"could not crop the KV cache to {keep} (have {cache_length(cache)})")
    return cache


def _slice_cache(cache, keep: int) -> None:
    if hasattr(cache, "layers"):
        for layer in cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys[..., :keep, :]
                layer.values = layer.values[..., :keep, :]
    elif hasattr(cache, "key_cache"):
        for i in range(len(cache.key_cache)):
            cache.key_cache[i] = cache.key_cache[i][..., :keep, :]
            cache.value_cache[i] = cache.value_cache[i][..., :keep, :]
        if hasattr(cache, "_seen_tokens"):
            cache._seen_tokens = keep


# ---------------------------------------------------------------------------- decoding


@dataclass
class Generation:
    """One prompt's decode: the new tokens and what producing them cost."""

    tokens: list[int]  # generated tokens (eos included when it was hit)
    target_forwards: int  # target forward passes, prefill included
    seconds: float  # wall clock, prefill included
    block_taus: list[int] = field(default_factory=list)  # speculative: tokens each verify emitted (incl. bonus)
    margins: list[float] = field(default_factory=list)  # greedy: top-1 minus top-2 logit per token
    ties: list[bool] = field(default_factory=list)  # greedy: top-2 within TIE_ULPS of top-1 in the logits' dtype


@functools.lru_cache(maxsize=None)
def _cache_argument(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _forward(target, input_ids: torch.Tensor, cache=None, **kwargs):
    """One target forward with the KV cache -> (output, cache).

    transformers renamed ``past_key_values`` to ``cache`` (argument and output field)
    around 5.2x; 5.17 knows only the old name. Pick whichever this model accepts.
    """
    name = _cache_argument(type(target))
    if cache is not None:
        kwargs[name] = cache
    out = target(input_ids=input_ids, use_cache=True, **kwargs)
    new_cache = getattr(out, name, None)
    if new_cache is None:
        new_cache = getattr(out, "past_key_values", None) if name == "cache" else getattr(out, "cache", None)
    if new_cache is None:
        raise RuntimeError(f"{type(target).__name__} returned no KV cache")
    return out, new_cache


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_stop(token: int, n_new: int, max_new_tokens: int, eos: frozenset[int]) -> bool:
    return token in eos or n_new >= max_new_tokens


def _layer_states(hidden_states, layer_ids: Sequence[int]) -> torch.Tensor:
    """(1, T, n * D): HF hidden_states[i + 1] of every chosen layer id i, concatenated."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


class EagerTarget:
    """The decoding loops' view of the target: forwards that extend one sequence's KV cache
    (transformers' dynamic cache, eager: the reference path), and ``crop`` to drop rejected drafts."""

    def __init__(self, target):
        self.target, self.device = target, device_of(target)
        self.cache = None

    def reset(self) -> None:
        self.cache = None

    @property
    def length(self) -> int:
        """Positions in the KV cache."""
        return 0 if self.cache is None else cache_length(self.cache)

    def forward(self, ids: Sequence[int], layer_ids: Sequence[int] | None = None, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``ids`` at the next positions -> (logits (n or 1, V), chosen layers' states (n, n_l * D) or None)."""
        kwargs = {"logits_to_keep": 1} if last_only else {}
        out, self.cache = _forward(self.target, torch.tensor([list(ids)], device=self.device), self.cache,
                                   output_hidden_states=layer_ids is not None, **kwargs)
        states = _layer_states(out.hidden_states, layer_ids)[0] if layer_ids is not None else None
        return out.logits[0], states

    def crop(self, keep: int) -> None:
        self.cache = crop_cache(self.cache, keep)


class StaticTarget(EagerTarget):
    """``EagerTarget`` on a static KV cache (transformers' ``StaticCache``, one for every prompt):
    a forward writes at the next positions and attends up to its own, so a crop only moves the
    length back (the next verify overwrites the rejected drafts; the cache's layers count their
    positions in a device tensor that a captured graph advances and, in 5.17, write at that
    count whatever positions are passed, so the crop moves that counter back in place too).
    With ``capture`` (CUDA) the forwards after the prefill, 1 token (greedy) or B tokens
    (verify), are compiled with CUDA graphs (``mode="reduce-overhead"``), once per shape;
    without, the same code runs eager."""

    def __init__(self, target, max_length: int, capture: bool = False):
        from transformers import StaticCache

        super().__init__(target)
        self.cache = StaticCache(config=target.config, max_cache_len=max_length)
        self.max_length, self._length = max_length, 0
        self._cache_name = _cache_argument(type(target))
        self._step = torch.compile(self._run, mode="reduce-overhead") if capture else self._run

    def reset(self) -> None:
        self.cache.reset()
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, hidden: bool):
        out = self.target(input_ids=ids, position_ids=positions[None], cache_position=positions, use_cache=True,
                          output_hidden_states=hidden, **{self._cache_name: self.cache})
        return out.logits, out.hidden_states

    def forward(self, ids, layer_ids=None, last_only=False):
        n = len(ids)
        if self._length + n > self.max_length:
            raise ValueError(f"static KV cache of {self.max_length} positions cannot take {self._length + n}")
        positions = torch.arange(self._length, self._length + n, device=self.device)
        run = self._run if self._length == 0 else self._step  # the prefill's length varies: eager
        logits, hidden = run(torch.tensor([list(ids)], device=self.device), positions, layer_ids is not None)
        self._length += n
        states = _layer_states(hidden, layer_ids)[0] if layer_ids is not None else None  # a copy (cat)
        return (logits[0, -1:] if last_only else logits[0]).clone(), states

    def crop(self, keep: int) -> None:
        if keep > self._length:
            raise ValueError(f"cannot crop a {self._length}-position cache to {keep}")
        for layer in getattr(self.cache, "layers", ()):
            counter = getattr(layer, "cumulative_length", None)  # transformers 5.17+: the layer writes there
            if keep < self._length and isinstance(counter, torch.Tensor):
                counter.sub_(self._length - keep)  # in place: a captured graph reads it at its address
        self._length = keep


@torch.inference_mode()
def greedy_generate(target, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_ids: Iterable[int] = (), session: EagerTarget | None = None) -> Generation:
    """Plain greedy decoding with the KV cache, one token per target forward (``session``: the
    target's forwards, default ``EagerTarget``)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device, eos = device_of(target), frozenset(int(t) for t in eos_token_ids)
    session = session or EagerTarget(target)
    session.reset()
    sync_device(device)
    start = time.perf_counter()
    logits, _ = session.forward(prompt_ids, last_only=True)
    tokens, margins, ties, forwards = [], [], [], 1
    eps = torch.finfo(logits.dtype).eps
    while True:
        top2 = logits[-1].float().topk(2)
        token = int(logits[-1].argmax())  # as the verify picks: topk may break an exact tie the other way
        tokens.append(token)
        margins.append(float(top2.values[0] - top2.values[1]))
        ties.append(margins[-1] <= TIE_ULPS * eps * abs(float(top2.values[0])))
        if _is_stop(token, len(tokens), max_new_tokens, eos):
            break
        logits, _ = session.forward([token], last_only=True)
        forwards += 1
    sync_device(device)
    return Generation(tokens, forwards, time.perf_counter() - start, margins=margins, ties=ties)


@torch.inference_mode()
def speculative_generate(target, proposer: Proposer, prompt_ids: Sequence[int], max_new_tokens: int,
                         eos_token_ids: Iterable[int] = (), session: EagerTarget | None = None) -> Generation:
    """DFlash speculative decoding at temperature 0 (see the module docstring)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device, eos = device_of(target), frozenset(int(t) for t in eos_token_ids)
    session = session or EagerTarget(target)
    session.reset()
    sequence = [int(t) for t in prompt_ids]  # prompt, then every emitted token
    n_prompt, B, layer_ids = len(sequence), proposer.block_size, list(proposer.target_layer_ids)
    sync_device(device)
    start = time.perf_counter()
    logits, prefill_states = session.forward(sequence, layer_ids, last_only=True)  # states (P, n * D)
    forwards = 1
    if hasattr(proposer, "reset"):  # a proposer that keeps state between calls starts over
        proposer.reset()
    # Drafter context of positions < p, filled as positions are verified.
    context = prefill_states.new_empty((1, n_prompt + max_new_tokens + B, prefill_states.shape[-1]))
    context[0, :n_prompt] = prefill_states
    sequence.append(int(logits[-1].argmax()))
    taus: list[int] = []
    done = _is_stop(sequence[-1], 1, max_new_tokens, eos)
    while not done:
        p = len(sequence) - 1  # position of the last accepted token, not yet in the cache
        if session.length != p:
            raise RuntimeError(f"KV cache holds {session.length} positions, expected {p}")
        drafts = proposer.propose(context[:, :p], sequence[:], p)
        if drafts.shape != (B - 1,):
            raise ValueError(f"proposer returned shape {tuple(drafts.shape)}, expected ({B - 1},)")
        drafts = [int(t) for t in drafts.tolist()]
        logits, states = session.forward([sequence[-1], *drafts], layer_ids)
        forwards += 1
        greedy = logits.argmax(dim=-1).tolist()  # the target's tokens for positions p+1 .. p+B
        accepted = 0
        while accepted < B - 1 and drafts[accepted] == greedy[accepted]:
            accepted += 1
        context[0, p:p + accepted + 1] = states[:accepted + 1]
        session.crop(p + accepted + 1)
        emitted = 0
        for token in drafts[:accepted] + [greedy[accepted]]:
            sequence.append(token)
            emitted += 1
            if _is_stop(token, len(sequence) - n_prompt, max_new_tokens, eos):
                done = True
                break
        taus.append(emitted)
    sync_device(device)
    return Generation(sequence[n_prompt:], forwards, time.perf_counter() - start, block_taus=taus)


# ---------------------------------------------------------------------------- evaluation


def mismatch_message(spec: Sequence[int], greedy: Sequence[int], margins: Sequence[float] = (),
                     where: str = "prompt") -> str | None:
    """None when the two token lists are identical, else what differs and where."""
    if list(spec) == list(greedy):
        return None
    first = next((i for i, (a, b) in enumerate(zip(spec, greedy)) if a != b), min(len(spec), len(greedy)))
    margin = f"; greedy top-2 logit margin there {margins[first]:.3g}" if first < len(margins) else ""
    return (
        f"{where}: speculative output differs from greedy at new token {first} "
        f"(speculative {list(spec[first:first + 5])}..., greedy {list(greedy[first:first + 5])}...; "
        f"lengths {len(spec)} vs {len(greedy)}{margin}). A margin near 0 is a numerical tie between a "
        "B-token verify and a 1-token decode (try float32); a clear margin means a decoding bug."
    )


def diverges_at_tie(spec: Sequence[int], greedy: Sequence[int], ties: Sequence[bool]) -> bool:
    """Whether the first token where the two decodes part was a numerical tie for greedy decoding:
    its top two logits within ``TIE_ULPS`` of each other in the logits' dtype, so a B-token verify
    and a 1-token decode may round them apart (bf16 ties are common: 8 bits of mantissa)."""
    first = next((i for i, (a, b) in enumerate(zip(spec, greedy)) if a != b), None)
    return first is not None and first < len(ties) and ties[first]


def check_lossless(spec: Sequence[int], greedy: Sequence[int], margins: Sequence[float] = (),
                   where: str = "prompt") -> None:
    """Raise LosslessError unless the two token lists are identical."""
    message = mismatch_message(spec, greedy, margins, where)
    if message is not None:
        raise LosslessError(message)


def tau_histogram(taus: Iterable[int], block_size: int) -> list[int]:
    counts = [0] * block_size  # counts[k - 1]: blocks that accepted k tokens
    for tau in taus:
        counts[tau - 1] += 1
    return counts


def _summary(new_tokens: int, taus: list[int], spec_fw: int, greedy_fw: int, spec_s: float, greedy_s: float,
             block_size: int) -> dict[str, Any]:
    return {
        "new_tokens": new_tokens,
        "blocks": len(taus),
        "tau": sum(taus) / len(taus) if taus else math.nan,
        "tau_histogram": tau_histogram(taus, block_size),
        "target_forwards": spec_fw,
        "greedy_target_forwards": greedy_fw,
        "tokens_per_target_forward": new_tokens / spec_fw,
        "spec_seconds": spec_s,
        "greedy_seconds": greedy_s,
        "spec_tokens_per_s": new_tokens / spec_s if spec_s > 0 else math.nan,
        "greedy_tokens_per_s": new_tokens / greedy_s if greedy_s > 0 else math.nan,
        "speedup": greedy_s / spec_s if spec_s > 0 else math.nan,
    }


def evaluate(target, drafter: DFlashDrafter | Proposer, prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int = 128, eos_token_ids: Iterable[int] = (), check: bool = True,
             warmup: bool = True, progress: bool = False, capture: bool = False) -> dict[str, Any]:
    """Speculative vs greedy decoding of every prompt (lists of token ids).

    Returns {"overall": {...}, "per_prompt": [{...}], "settings": {...}} where each
    summary holds tau (mean tokens accepted per drafter block, bonus included),
    tau_histogram (blocks accepting 1..B tokens), tokens_per_target_forward (prefill
    counted; greedy is 1.0 by construction), both wall-clock times and the speedup
    (greedy time / speculative time). tau counts the tokens each block emitted, so
    new_tokens == 1 + sum(block taus) (the first token comes from the prefill), and a
    block cut by eos or max_new_tokens counts only what it output. This is the quantity
    training scores per block on cached sequences (``dflash.train.metrics.block_taus``)
    and walks as decoding walks (``dflash.train.replay``, training's held-out ``tau``). With ``check`` a
    mismatch raises LosslessError at the first prompt that shows it; without, each row
    records it ("lossless", "mismatch") and the caller decides. With ``capture`` both decoders
    run on one ``StaticTarget`` (static KV cache; on CUDA its decode and verify forwards in
    CUDA graphs) and, on CUDA, the drafter's block forward is compiled (inductor), so launch
    overhead does not decide the speedup.
    """
    backend = "inductor" if capture and device_of(target).type == "cuda" else None
    proposer = (DFlashProposer(drafter, target, compile_backend=backend) if isinstance(drafter, DFlashDrafter)
                else drafter)
    eos = sorted({int(t) for t in eos_token_ids})
    B = proposer.block_size
    session = None
    if capture and prompts:
        max_length = max(len(p) for p in prompts) + max_new_tokens + 2 * B
        session = StaticTarget(target, max_length, capture=device_of(target).type == "cuda")
    if warmup and prompts:  # first calls pay for allocator growth, kernels, lazy init, graph capture
        for _ in range(2 if session is not None else 1):
            greedy_generate(target, prompts[0], min(4, max_new_tokens), eos, session)
            speculative_generate(target, proposer, prompts[0], min(2 * B, max_new_tokens), eos, session)

    from tqdm.auto import tqdm

    per_prompt, all_taus = [], []
    totals = dict(new=0, spec_fw=0, greedy_fw=0, spec_s=0.0, greedy_s=0.0)
    for index, prompt in enumerate(tqdm(prompts, desc="dflash-eval", unit="prompt", disable=not progress)):
        greedy = greedy_generate(target, prompt, max_new_tokens, eos, session)
        spec = speculative_generate(target, proposer, prompt, max_new_tokens, eos, session)
        mismatch = mismatch_message(spec.tokens, greedy.tokens, greedy.margins, where=f"prompt {index}")
        tie = mismatch is not None and diverges_at_tie(spec.tokens, greedy.tokens, greedy.ties)
        if check and mismatch is not None and not tie:
            raise LosslessError(mismatch)
        n_new = len(spec.tokens)
        row = {"index": index, "prompt_tokens": len(prompt), "lossless": mismatch is None, "mismatch": mismatch,
               "tie": tie,
               **_summary(n_new, spec.block_taus, spec.target_forwards, greedy.target_forwards,
                          spec.seconds, greedy.seconds, B),
               "block_taus": spec.block_taus, "tokens": spec.tokens}
        per_prompt.append(row)
        all_taus += spec.block_taus
        totals["new"] += n_new
        totals["spec_fw"] += spec.target_forwards
        totals["greedy_fw"] += greedy.target_forwards
        totals["spec_s"] += spec.seconds
        totals["greedy_s"] += greedy.seconds
    overall = {"prompts": len(per_prompt), "lossless": all(r["lossless"] or r["tie"] for r in per_prompt),
               "ties": sum(r["tie"] for r in per_prompt)}
    if per_prompt:
        overall.update(_summary(totals["new"], all_taus, totals["spec_fw"], totals["greedy_fw"],
                                totals["spec_s"], totals["greedy_s"], B))
    device = device_of(target)
    settings = {"block_size": B, "max_new_tokens": max_new_tokens, "eos_token_ids": eos, "capture": capture,
                "target_layer_ids": list(proposer.target_layer_ids), "device": str(device),
                "dtype": str(next(target.parameters()).dtype).removeprefix("torch.")}
    return {"overall": overall, "per_prompt": per_prompt, "settings": settings}
