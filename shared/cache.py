"""The hidden-state cache: one Zarr v3 store, the contract between extract and train.

Every array is flat and token-major, chunked along tokens (rows per chunk in ``CacheSpec.chunks``), compressed with
byte shuffle + zstd and checksummed (crc32c)::

    CACHE/                      root attributes: ``dflash_cache`` (see ``CacheSpec``)
      shards/00000/             one group per shard, written by exactly one process
        input_ids      [T]          int32
        loss_mask      [T]          bool   (assistant tokens)
        hidden         [T, L, D]    uint16 (bf16 bits), or [T, L, W] uint8 (a lossy codec's payload)
        hidden_scale   [T, L, G]    float16 or float32 (lossy codecs only: their scales)
        topk_ids       [T, k]       int32
        topk_logprobs  [T, k]       float32 (or float16, or bf16 bits as uint16: ``topk_dtype``)
        offsets        [N + 1]      int64  (sample i is tokens offsets[i]:offsets[i+1])
        source_index   [N]          int64  (row of sample i in the source dataset)
        batches        [NB + 1]     int64  (sample offsets of the planned batches)

A shard is planned first (every array has its final shape); the writer appends whole batches in plan order. A
commit stores every buffered token, then records the committed counts in the shard's attributes; readers never look
past that record, so a crash leaves a shard valid up to its last commit and a rerun resumes byte-identically.

Format versions: 1 chunks every token array at ``chunk_tokens`` rows; 2 (the lossless default) chunks the small
arrays coarsely (``default_chunks``); 3 is 2 with a lossy ``hidden_codec`` or a reduced ``topk_dtype``, so that older
readers refuse it. Readers take each array's chunking from its own metadata.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
import zarr
import zarr.codecs as zc
from zarr.core.sync import sync as zarr_sync

from . import hidden_codecs
from .compression import TOPK_DTYPES, is_local
from .hidden_codecs import EncodedHidden, HiddenCodec
from .shard_lock import LOCKS_DIR as LOCKS_GROUP, live_holders

FORMAT_NAME = "dflash-cache"
FORMAT_VERSION = 2  # the lossless default (bf16 hidden states, float32 log-probs)
ENCODED_FORMAT_VERSION = 3  # a lossy hidden_codec or a topk_dtype other than float32
READABLE_VERSIONS = (1, 2, 3)
ATTRS_KEY = "dflash_cache"
LAYER_CONVENTION = ("layer id i = output of decoder layer i (0-based) = HF output_hidden_states[i + 1]; "
                    "hidden_states[0] is the embedding output")
TOKEN_FIELDS = ("input_ids", "loss_mask", "hidden", "topk_ids", "topk_logprobs")  # what a reader asks for
HIDDEN_SCALE = "hidden_scale"
META_FIELDS = ("offsets", "source_index", "batches")  # the sample-level arrays, written once at creation
_TOPK_STORED = {"float32": "float32", "float16": "float16", "bfloat16": "uint16"}  # zarr has no bfloat16
# the encoding fields at their lossless defaults; a lossless spec writes none of them
ENCODING_DEFAULTS = {"hidden_codec": "bf16", "hidden_group_size": None, "hidden_scale_dtype": None,
                     "topk_dtype": "float32"}
SAMPLE_META_CHUNK = 1 << 16
ZARR_PIPELINE = "zarr.core.codec_pipeline.BatchedCodecPipeline"
ZARRS_PIPELINE = "zarrs.ZarrsCodecPipeline"  # Rust, off the GIL: several times zarr's own decoding speed
SMALL_CHUNK_BYTES = 1 << 20  # raw bytes aimed at per chunk of the small token arrays (format 2)
SMALL_CHUNK_MAX_TOKENS = 1 << 16  # reading one sample decodes whole chunks
SPAN_BYTES = 256 << 20  # what read_many reads at once, as stored (about 43k tokens of SmolLM2's 5 layers)

log = logging.getLogger(__name__)


class CacheError(Exception):
    """A cache that cannot be opened, written or trusted."""


class CacheMismatch(CacheError):
    """The cache differs from what the caller needs; ``differences`` names each one."""

    def __init__(self, what: str, differences: list[str]):
        self.differences = differences
        super().__init__(f"{what}:\n  - " + "\n  - ".join(differences))


@dataclass
class CacheSpec:
    """What a cache holds; stored whole in the root attributes under ``dflash_cache``."""

    layer_ids: list[int]  # target layers stored, in hidden[:, j] order (see LAYER_CONVENTION)
    hidden_size: int
    topk: int  # target log-probs stored per position
    vocab_size: int
    num_target_layers: int
    max_length: int
    truncation: str  # for samples over max_length: 'right' keeps the first max_length tokens
    chunk_tokens: int = 256  # tokens per chunk of the hidden states (format 1: of every token array)
    compression_level: int = 1  # zstd level (blosc stores clevel c and runs zstd at 2c-1)
    fingerprint: dict[str, Any] = field(default_factory=dict)  # what made the values; a resume must match it
    info: dict[str, Any] = field(default_factory=dict)  # free-form run information; not compared
    hidden_dtype: str = "bfloat16"
    stored_dtypes: dict[str, str] = field(default_factory=dict)  # of the token arrays (set from the encoding)
    layer_convention: str = LAYER_CONVENTION
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    chunks: dict[str, int] = field(default_factory=dict)  # rows per chunk of each token array (format 2 and 3)
    hidden_codec: str = "bf16"  # 'bf16' (lossless bits) or a lossy hidden_codecs mode: 'fp8', 'int8', 'int4'
    hidden_group_size: int | None = None  # channels per scale of the int codecs
    hidden_scale_dtype: str | None = None  # dtype of hidden_scale (lossy codecs only)
    topk_dtype: str = "float32"  # of the stored top-k log-probs: 'float32', 'float16' or 'bfloat16'

    def __post_init__(self):
        if self.topk_dtype not in TOPK_DTYPES:
            raise CacheError(f"cache spec: topk_dtype {self.topk_dtype!r}, expected one of {TOPK_DTYPES}")
        try:
            codec = self.codec
            codec.check_hidden_size(self.hidden_size)  # whole groups (only the int codecs have them)
        except ValueError as e:
            raise CacheError(f"cache spec: {e}") from None
        self.hidden_group_size = codec.group_size if codec.grouped else None  # None where the mode has none
        self.hidden_scale_dtype = codec.scale_dtype if codec.lossy else None
        if self.format_version in (FORMAT_VERSION, ENCODED_FORMAT_VERSION):  # the current format of this encoding
            self.format_version = ENCODED_FORMAT_VERSION if self.encoded else FORMAT_VERSION
        if self.encoded and self.format_version < ENCODED_FORMAT_VERSION:
            raise CacheError(f"cache spec: format {self.format_version} cannot hold hidden {codec.describe()}, "
                             f"top-k log-probs {self.topk_dtype}")
        self.stored_dtypes = {f: dtype for f, (_, dtype) in token_array_shapes(self, 1).items()}
        if self.format_version >= 2 and not self.chunks:
            self.chunks = default_chunks(self)
        if self.format_version >= 2 and set(self.chunks) != set(self.token_fields):
            raise CacheError(f"cache spec: chunks must name each of {self.token_fields}, got {sorted(self.chunks)}")

    def with_encoding(self, **changes) -> "CacheSpec":
        """This spec with ``changes`` (encoding fields, layout), in the current format and default chunks."""
        return dataclasses.replace(self, **changes, format_version=FORMAT_VERSION, chunks={})

    codec = property(lambda self: HiddenCodec(self.hidden_codec, self.hidden_group_size or 128,
                                              self.hidden_scale_dtype or "float16"))
    encoded = property(lambda self: self.hidden_codec != "bf16" or self.topk_dtype != "float32")  # format 3
    token_fields = property(lambda self: TOKEN_FIELDS + ((HIDDEN_SCALE,) if self.hidden_codec != "bf16" else ()))
    num_layers = property(lambda self: len(self.layer_ids))

    def encoding(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ENCODING_DEFAULTS}

    def chunk_rows(self, name: str) -> int:
        return int(self.chunks[name]) if self.format_version >= 2 else self.chunk_tokens

    def to_dict(self) -> dict[str, Any]:  # a lossless spec writes no encoding fields: its attributes are format 2's
        return {k: v for k, v in dataclasses.asdict(self).items() if self.encoded or k not in ENCODING_DEFAULTS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CacheSpec":
        if d.get("format") != FORMAT_NAME:
            raise CacheError(f"not a {FORMAT_NAME} store (format={d.get('format')!r})")
        if d.get("format_version") not in READABLE_VERSIONS:
            raise CacheError(f"cache format version {d.get('format_version')} is not supported "
                             f"(this code reads versions {', '.join(map(str, READABLE_VERSIONS))})")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def default_chunks(spec: CacheSpec) -> dict[str, int]:
    """Format 2's rows per chunk: the hidden states at ``chunk_tokens``; each small array at the power of two whose
    raw chunk is closest under ``SMALL_CHUNK_BYTES``, within [``chunk_tokens``, ``SMALL_CHUNK_MAX_TOKENS``]."""
    def rows(row_bytes: int) -> int:
        return 1 << max(0, (SMALL_CHUNK_BYTES // row_bytes).bit_length() - 1)
    return {name: spec.chunk_tokens if name in ("hidden", HIDDEN_SCALE) else
            max(spec.chunk_tokens, min(rows(size), SMALL_CHUNK_MAX_TOKENS))
            for name, size in stored_row_bytes(spec).items()}


def diff_dicts(ours: Any, theirs: Any, prefix: str = "") -> list[str]:
    """Every leaf where two JSON-like values differ, as 'path: a != b' lines."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = []
        for key in sorted(set(ours) | set(theirs), key=str):
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in ours:
                out.append(f"{path}: missing in cache, run has {theirs[key]!r}")
            elif key not in theirs:
                out.append(f"{path}: cache has {ours[key]!r}, missing in run")
            else:
                out.extend(diff_dicts(ours[key], theirs[key], path))
        return out
    plain = [json.loads(json.dumps(x, default=str)) for x in (ours, theirs)]  # 1 == 1.0, a tuple == its list
    return [] if plain[0] == plain[1] else [f"{prefix}: cache has {ours!r}, run has {theirs!r}"]


def writer_zarr_settings(path: str) -> dict[str, Any]:
    """A shard writer's zarr settings: the zarrs pipeline (off the GIL) for a local folder, zarr's own for a URL."""
    pipeline = ZARRS_PIPELINE if is_local(path) else ZARR_PIPELINE
    return {"codec_pipeline.path": pipeline, "async.concurrency": 32, "array.write_empty_chunks": True}


def _compressors(typesize: int, level: int) -> list:
    """Byte shuffle + zstd inside blosc (explicit block size: the automatic one costs a fifth of the ratio on
    bf16), then a crc32c checksum of the encoded chunk."""
    blosc = zc.BloscCodec(cname="zstd", clevel=max(1, (level + 1) // 2), shuffle="shuffle", typesize=typesize,
                          blocksize=1 << 19)  # blosc clevel c -> zstd level 2c - 1
    return [blosc, zc.Crc32cCodec()]


def token_array_shapes(spec: CacheSpec, tokens: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shape and stored dtype of each token array (``spec.token_fields``) for ``tokens`` rows."""
    k, L, D, codec = spec.topk, spec.num_layers, spec.hidden_size, spec.codec
    shapes = {
        "input_ids": ((tokens,), "int32"),
        "loss_mask": ((tokens,), "bool"),
        "hidden": ((tokens, L, codec.payload_width(D)), "uint8") if codec.lossy else ((tokens, L, D), "uint16"),
        "topk_ids": ((tokens, k), "int32"),
        "topk_logprobs": ((tokens, k), _TOPK_STORED[spec.topk_dtype]),
    }
    if codec.lossy:
        shapes[HIDDEN_SCALE] = ((tokens, L, codec.groups(D)), codec.scale_dtype)
    return shapes


def stored_row_bytes(spec: CacheSpec) -> dict[str, int]:
    """Stored bytes per token of each token array, before compression."""
    return {f: int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize
            for f, (shape, dtype) in token_array_shapes(spec, 1).items()}


def encode_hidden(spec: CacheSpec, hidden: torch.Tensor, validate: bool = True) -> dict[str, torch.Tensor]:
    """``[T, L, D]`` hidden states -> the stored ``hidden`` (+ ``hidden_scale``) tensors, on ``hidden``'s device."""
    if not spec.codec.lossy:
        return {"hidden": hidden.to(torch.bfloat16).view(torch.int16)}
    enc = hidden_codecs.encode(spec.codec, hidden, validate=validate)
    return {"hidden": enc.payload, HIDDEN_SCALE: enc.scales}


def decode_hidden(spec: CacheSpec, stored: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The stored ``hidden`` (+ ``hidden_scale``) -> ``[..., L, D]`` in ``dtype``; bitwise the same on CPU and GPU."""
    if not spec.codec.lossy:
        return bf16_from_bits(stored["hidden"]).to(dtype)
    encoded = EncodedHidden(torch.as_tensor(stored["hidden"]), torch.as_tensor(stored[HIDDEN_SCALE]))
    return hidden_codecs.decode(spec.codec, encoded, dtype)


def encode_topk_logprobs(spec: CacheSpec, logprobs: torch.Tensor) -> torch.Tensor:
    """float log-probs ``[T, k]`` -> the stored ``topk_logprobs`` (bf16 as its int16 bits)."""
    stored = logprobs.to(getattr(torch, spec.topk_dtype))
    return stored.view(torch.int16) if spec.topk_dtype == "bfloat16" else stored


def decode_topk_logprobs(spec: CacheSpec, stored) -> torch.Tensor:
    """The stored ``topk_logprobs`` (numpy or tensor) -> float32 log-probs."""
    return (bf16_from_bits(stored) if spec.topk_dtype == "bfloat16" else torch.as_tensor(stored)).float()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host tensor as the numpy array the writer stores (int16 bit patterns as uint16)."""
    a = t.numpy()
    return a.view(np.uint16) if a.dtype == np.int16 else a


def bf16_from_bits(bits) -> torch.Tensor:  # uint16 numpy, or an int16/uint16 tensor on any device
    return torch.as_tensor(bits).view(torch.bfloat16)


def bf16_to_bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def open_root(path: str, mode: str = "r") -> zarr.Group:
    options = {"auto_mkdir": True} if str(path).startswith("file://") else None  # else fsspec makes no folders
    try:
        return zarr.open_group(store=path, mode=mode, zarr_format=3, storage_options=options)
    except FileNotFoundError as e:
        raise CacheError(f"{path}: no cache there ({e})") from e
    except Exception as e:  # zarr raises several kinds for a missing or foreign store
        raise CacheError(f"{path}: cannot open as a Zarr v3 cache: {e}") from e


def open_spec(path: str) -> tuple[zarr.Group, CacheSpec]:
    """The cache root (read-only) and its spec; CacheError for a store that is no cache."""
    root = open_root(path)
    if ATTRS_KEY not in root.attrs:
        raise CacheError(f"{path}: a Zarr store but not a dflash cache (no '{ATTRS_KEY}' attribute)")
    return root, CacheSpec.from_dict(root.attrs[ATTRS_KEY])


def _new_root(root: zarr.Group, spec: CacheSpec) -> zarr.Group:
    root.attrs[ATTRS_KEY] = spec.to_dict()
    root.require_group("shards")
    root.require_group(LOCKS_GROUP)
    return root


def create_or_open_cache(path: str, spec: CacheSpec, *, replace_uncommitted: bool = False) -> zarr.Group:
    """Create the cache root, or reopen one with the same fingerprint and layout; another is refused naming every
    difference, or with ``replace_uncommitted`` and no committed sample, replaced with a warning."""
    root = open_root(path, "a")
    existing = root.attrs.get(ATTRS_KEY)
    if existing is None:
        if list(root.keys()):
            raise CacheError(f"{path}: holds Zarr data that is not a dflash cache; refusing to write there")
        return _new_root(root, spec)
    old = CacheSpec.from_dict(existing)
    if old.format_version < spec.format_version and old.encoding() == spec.encoding():
        # an older layout is resumed in its own layout
        spec = dataclasses.replace(spec, format_version=old.format_version, chunks=dict(old.chunks))
    diffs = spec_differences(old, spec)
    if not diffs:
        root.require_group(LOCKS_GROUP)  # a cache made before shards had locks has none
        return root
    if not replace_uncommitted or committed_samples(root) > 0:
        raise CacheMismatch(f"{path} holds a cache with another fingerprint; use another --out or delete it", diffs)
    writing = live_holders(path)
    if writing:
        raise CacheError(f"{path} holds a cache with another fingerprint, in which no shard committed a sample yet, "
                         "but another run is writing it: " + "; ".join(
                             f"shard {s:05d} by {h.describe()}" for s, h in sorted(writing.items())))
    log.warning("%s: replacing a cache root made with another fingerprint, in which no shard committed a sample "
                "(left by a run that failed before its first commit); differences:\n  - %s", path, "\n  - ".join(diffs))
    for name in list(root.keys()):  # the shards first: a crash in between leaves a root that is still uncommitted
        if name != LOCKS_GROUP:
            del root[name]
    return _new_root(root, spec)


def spec_differences(old: CacheSpec, new: CacheSpec) -> list[str]:
    """Every difference between two specs that makes one cache's bytes differ from the other's."""
    compared = ("layer_ids", "hidden_size", "topk", "vocab_size", "num_target_layers", "max_length",
                "truncation", "chunk_tokens", "compression_level", "hidden_dtype", *ENCODING_DEFAULTS, "fingerprint",
                "format_version", "chunks")
    return [d for name in compared for d in diff_dicts({name: getattr(old, name)}, {name: getattr(new, name)})]


def committed_samples(root: zarr.Group) -> int:
    """Samples committed by all shards of a cache root (0 where it has none yet)."""
    return sum(state.commit.samples for state in read_shard_states(root).values() if state)


def shard_name(shard_id: int) -> str:
    return f"shards/{shard_id:05d}"


@dataclass
class ShardCounts:
    """Batches, samples and tokens of a shard: planned, or committed so far."""

    batches: int = 0
    samples: int = 0
    tokens: int = 0
    as_dict = dataclasses.asdict


@dataclass
class ShardState:
    """What a shard records in its group's attributes; ``commit`` is the commit point readers never look past."""

    plan_digest: str  # of the plan (rows, lengths, batches, skips); a resume must plan the same
    planned: ShardCounts  # what the shard holds once complete: every array's size from the start
    skipped: dict[str, int] = field(default_factory=dict)  # rows of the shard's slice not planned, by reason
    commit: ShardCounts = field(default_factory=ShardCounts)  # recorded after its bytes were stored
    complete: bool = False
    compute: dict[str, Any] | None = None  # what computed the values (device, kernels, versions); a resume matches it

    status = property(lambda self: "complete" if self.complete else "partial" if self.commit.samples else "empty")
    to_attrs = dataclasses.asdict  # in field order: the order of the keys in the stored attributes

    @classmethod
    def from_attrs(cls, attrs: dict[str, Any]) -> "ShardState":
        """Parse a shard's attributes; raises ValueError naming what is missing or malformed."""
        try:
            counts = {key: ShardCounts(**{k: int(attrs[key][k]) for k in ("batches", "samples", "tokens")})
                      for key in ("planned", "commit")}
            return cls(plan_digest=str(attrs["plan_digest"]), **counts, complete=bool(attrs.get("complete", False)),
                       skipped={str(k): int(v) for k, v in (attrs.get("skipped") or {}).items()},
                       compute=attrs.get("compute"))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"missing or malformed shard attributes ({type(e).__name__}: {e})") from None


def read_shard_state(group: zarr.Group) -> ShardState:
    """The state a shard group records; CacheError naming the group where it cannot be parsed."""
    try:
        return ShardState.from_attrs(group.attrs.asdict())
    except ValueError as e:
        raise CacheError(f"{group.path}: {e}") from None


def shard_recorded(group: zarr.Group) -> bool:
    """Whether a shard group records a state (``ShardWriter`` writes it last: a group without one is being created)."""
    return bool(group.attrs.asdict())


def read_shard_states(root: zarr.Group, shard_ids: Iterable[int] | None = None) -> dict[int, ShardState | None]:
    """The state of each of these shards (default: all), None for a shard not created (or not recorded) yet."""
    if shard_ids is None:
        names = sorted(root["shards"].group_keys()) if "shards" in root else []
        if stray := [name for name in names if not name.isdigit()]:
            raise CacheError(f"{root.store}: shards/{stray[0]} is no shard group "
                             "(those are numbered 00000, 00001, ...)")
        shard_ids = [int(name) for name in names]
    groups = {s: root.get(shard_name(s)) for s in shard_ids}
    return {s: read_shard_state(g) if g is not None and shard_recorded(g) else None for s, g in groups.items()}


def _record_state(group: zarr.Group, state: ShardState, *keys: str) -> None:
    """Write these fields of ``state`` (all without ``keys``) in one metadata write, never a torn record."""
    attrs = state.to_attrs()
    group.update_attributes({k: attrs[k] for k in keys} if keys else attrs)  # merged with what is there


@dataclass
class ShardPlan:
    """The samples of one shard, in write order, fixed before any forward pass."""

    source_index: np.ndarray  # (N,) row of each sample in the source dataset
    lengths: np.ndarray  # (N,) tokens of each sample (after truncation)
    batches: np.ndarray  # (NB + 1,) sample offsets where each planned batch starts; last = N
    skipped: dict[str, int] = field(default_factory=dict)  # rows of this shard's slice not planned, by reason

    def __post_init__(self):
        self.source_index = np.asarray(self.source_index, dtype=np.int64)
        self.lengths = np.asarray(self.lengths, dtype=np.int64)
        self.batches = b = np.asarray(self.batches, dtype=np.int64)
        n = len(self.source_index)
        if len(self.lengths) != n:
            raise ValueError("plan: lengths and source_index differ in length")
        if len(b) < 1 or b[0] != 0 or b[-1] != n or np.any(np.diff(b) <= 0):
            raise ValueError("plan: batches must be increasing sample offsets from 0 to N")
        if n and self.lengths.min() <= 0:
            raise ValueError("plan: every sample needs at least one token")

    offsets = property(lambda self: np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64))
    num_tokens = property(lambda self: int(self.lengths.sum()))

    def digest(self) -> str:
        arrays = b"".join(np.ascontiguousarray(a).tobytes() for a in (self.source_index, self.lengths, self.batches))
        return hashlib.sha256(arrays + json.dumps(self.skipped, sort_keys=True).encode()).hexdigest()


class ShardWriter:
    """Writes one shard in whole planned batches, in order; the partial tail chunk waits for ``commit``. A chunk holding
    committed rows is rewritten through zarr's own pipeline, which replaces a local file in one step (zarrs may
    truncate first). A shard with committed samples refuses to resume under another ``compute`` (other rounding)."""

    def __init__(self, root: zarr.Group, shard_id: int, plan: ShardPlan, spec: CacheSpec,
                 compute: dict[str, Any] | None = None, guard: Callable[[], None] = lambda: None):
        self.guard = guard  # before each commit record, e.g. that this process still holds the shard's lock
        self.spec, self.plan, self.shard_id = spec, plan, shard_id
        self._offsets = plan.offsets
        name = shard_name(shard_id)
        if name in root and not shard_recorded(root[name]):
            log.warning("shard %05d: created but never recorded (its creator died creating it); made anew", shard_id)
            del root[name]  # nothing of it is committed, and this process holds the shard
        if name in root:
            self.group = root[name]
            self.state = read_shard_state(self.group)
            if self.state.plan_digest != plan.digest():
                raise CacheError(f"shard {shard_id:05d} was planned differently (other rows, order or batches); "
                                 "the data, tokenizer or worker count changed since it was written")
            commit, recorded = self.state.commit, self.state.compute
            finished = commit.batches >= len(plan.batches) - 1  # nothing left to compute
            if compute is not None and recorded != compute and not finished:
                if commit.tokens and recorded is not None:
                    diff = "; ".join(f"{k}: {recorded.get(k)!r} then, {compute.get(k)!r} now"
                                     for k in sorted(set(recorded) | set(compute)) if recorded.get(k) != compute.get(k))
                    raise CacheError(f"shard {shard_id:05d} has {commit.samples} samples computed elsewhere ({diff}); "
                                     "resuming it here would mix two numerics in one shard. Rerun it where it was "
                                     f"started, or delete the folder {name} of the cache and rerun to redo that shard "
                                     "from the start")
                if not commit.tokens:  # nothing computed yet: the shard is this run's
                    self.state.compute = compute
                    _record_state(self.group, self.state, "compute")
        else:
            self.group = root.create_group(name)
            T = max(plan.num_tokens, 1)
            for fname, (shape, dtype) in token_array_shapes(spec, plan.num_tokens).items():
                self.group.create_array(fname, shape=shape, chunks=(min(spec.chunk_rows(fname), T),) + shape[1:],
                                        dtype=dtype, fill_value=0,
                                        compressors=_compressors(np.dtype(dtype).itemsize, spec.compression_level))
            for fname, values in zip(META_FIELDS, (self._offsets, plan.source_index, plan.batches)):
                arr = self.group.create_array(fname, shape=values.shape, dtype="int64", fill_value=0,
                                              chunks=(min(SAMPLE_META_CHUNK, max(len(values), 1)),),
                                              compressors=_compressors(8, spec.compression_level))
                if len(values):
                    arr[:] = values
            planned = ShardCounts(len(plan.batches) - 1, len(plan.source_index), plan.num_tokens)
            self.state = ShardState(plan.digest(), planned, skipped=dict(plan.skipped), compute=compute)
            _record_state(self.group, self.state)
        self.fields = spec.token_fields
        self.arrays = {f: self.group[f] for f in self.fields}
        with zarr.config.set({"codec_pipeline.path": ZARR_PIPELINE}):
            self._atomic_arrays = {f: self.group[f] for f in self.fields}  # for chunks that hold committed rows
        self.chunks = {f: int(a.chunks[0]) for f, a in self.arrays.items()}  # as stored: a shard keeps its layout
        self.committed = self.state.commit.as_dict()
        self.next_batch = self.state.commit.batches
        done = self._end = self.state.commit.tokens  # _end: tokens handed to write_batch so far
        # per array, the rows from _tail_start[f] (a chunk boundary) to _end not yet written whole; a resume
        # inside a chunk reads back its committed head, to rewrite it with the chunk
        self._tail_start = {f: (done // C) * C for f, C in self.chunks.items()}
        self._tail = {f: [np.asarray(self.arrays[f][t:done])] if t < done else [] for f, t in self._tail_start.items()}

    complete = property(lambda self: self.next_batch >= len(self.plan.batches) - 1)

    def batch_samples(self, batch: int) -> tuple[int, int]:
        return int(self.plan.batches[batch]), int(self.plan.batches[batch + 1])

    def write_batch(self, batch: int, **fields: np.ndarray) -> None:
        """Append planned batch ``batch``: one token-major array per stored field, as stored."""
        if batch != self.next_batch:
            raise CacheError(f"shard {self.shard_id:05d}: batch {batch} written out of order "
                             f"(expected {self.next_batch})")
        s0, s1 = self.batch_samples(batch)
        ntok = int(self._offsets[s1] - self._offsets[s0])
        if set(fields) != set(self.fields):
            raise CacheError(f"write_batch needs exactly {self.fields}, got {sorted(fields)}")
        expected = token_array_shapes(self.spec, ntok)
        for f, a in fields.items():
            shape, dtype = expected[f]
            if tuple(a.shape) != shape:
                raise CacheError(f"shard {self.shard_id:05d} batch {batch}: {f} has shape {tuple(a.shape)}, "
                                 f"plan says {shape}")
            self._tail[f].append(np.ascontiguousarray(a, dtype=dtype))
        self._end += ntok
        self.next_batch += 1
        self._flush(final=False)

    def _flush(self, final: bool) -> None:
        """Write each array's whole chunks (and, when ``final``, its partial last one). A buffer starts on a chunk
        boundary and keeps the partial chunk a final flush wrote, to rewrite it whole: only it holds committed rows."""
        end, committed = self._end, self.committed["tokens"]
        for f in self.fields:
            C, start = self.chunks[f], self._tail_start[f]
            cut = end if final else start + ((end - start) // C) * C
            if cut <= start:
                continue
            keep_from = (cut // C) * C
            parts = self._tail[f]
            data = np.concatenate(parts) if len(parts) > 1 else parts[0]
            fresh_from = start
            if start < committed:  # its committed rows are rewritten: in one step, never torn
                fresh_from = min(cut, start + C)
                self._atomic_arrays[f][start:fresh_from] = data[: fresh_from - start]
            if fresh_from < cut:
                self.arrays[f][fresh_from:cut] = data[fresh_from - start: cut - start]
            rest = data[keep_from - start:].copy()
            self._tail[f] = [rest] if len(rest) else []
            self._tail_start[f] = keep_from

    def commit(self) -> dict[str, int]:
        """Make every batch written so far durable, then record it. Returns the record."""
        self._flush(final=True)  # every row is stored before the record says so
        s = int(self.plan.batches[self.next_batch])
        record = ShardCounts(batches=self.next_batch, samples=s, tokens=int(self._offsets[s]))
        if record != self.state.commit:
            self.guard()
            self.state.commit, self.state.complete = record, self.complete
            _record_state(self.group, self.state, "commit", "complete")
            self.committed = record.as_dict()
        return record.as_dict()

    def finish(self) -> None:
        if not self.complete:
            raise CacheError(f"shard {self.shard_id:05d}: finish() before its last batch")
        self.commit()
        if not self.state.complete:
            self.state.complete = True
            _record_state(self.group, self.state, "complete")


@dataclass
class ShardInfo:
    """One shard as a reader sees it."""

    shard_id: int
    record: ShardState
    samples = property(lambda self: self.record.commit.samples)
    tokens = property(lambda self: self.record.commit.tokens)
    complete = property(lambda self: self.record.complete)
    state = property(lambda self: self.record.status)


class CacheReader:
    """Random access by global sample index over the committed samples of every shard (or of ``shard_ids``). Opening
    reads the shards' states and offsets only; picklable (a DataLoader worker reopens the store lazily). It reads
    through zarr's own codec pipeline, since a forked worker hangs in zarrs if its parent used it; ``read_many``
    (preload, after which no worker forks) reads a local cache through zarrs, which decodes several times as fast."""

    def __init__(self, path: str, shard_ids: Iterable[int] | None = None):
        self.path = path
        self._arrays: dict[tuple[int, str], zarr.Array] = {}
        self._root, self.spec = open_spec(path)
        self.shards: list[ShardInfo] = []
        self._offsets = []
        for sid, state in sorted(read_shard_states(self.root, shard_ids).items()):
            if state is None:
                continue  # not created, or being created: nothing in it is committed
            self.shards.append(ShardInfo(sid, state))
            c = state.commit
            off = (np.asarray(self._array(len(self.shards) - 1, "offsets")[: c.samples + 1]) if c.samples
                   else np.zeros(1, np.int64))
            if off[-1] != c.tokens:
                raise CacheError(f"{path}: shard {sid:05d}: offsets disagree with its commit record")
            self._offsets.append(off)
        self._sources: list[np.ndarray | None] = [None] * len(self.shards)
        self._starts = np.concatenate([[0], np.cumsum([s.samples for s in self.shards])]).astype(np.int64)

    @property
    def root(self) -> zarr.Group:
        if self._root is None:
            self._root = open_root(self.path)
        return self._root

    def _array(self, pos: int, name: str, zarrs: bool = False) -> zarr.Array:  # opened on first use and kept open
        if (pos, name, zarrs) not in self._arrays:
            shard, local = f"{self.shards[pos].shard_id:05d}", zarrs and is_local(self.path)
            try:
                with zarr.config.set({"codec_pipeline.path": ZARRS_PIPELINE if local else ZARR_PIPELINE}):
                    self._arrays[pos, name, zarrs] = self.root["shards"][shard][name]  # the pipeline it opens with
            except KeyError:
                raise CacheError(f"{self.path}: shard {shard} has no array {name}") from None
        return self._arrays[pos, name, zarrs]

    def _source(self, pos: int) -> np.ndarray:  # the committed source_index of the shard at pos, read once
        if self._sources[pos] is None:
            n = self.shards[pos].samples
            self._sources[pos] = np.asarray(self._array(pos, "source_index")[:n]) if n else np.zeros(0, np.int64)
        return self._sources[pos]

    def __getstate__(self):
        return {**self.__dict__, "_root": None, "_arrays": {}}

    def __len__(self) -> int:
        return int(self._starts[-1])

    num_tokens = property(lambda self: int(sum(s.tokens for s in self.shards)))
    complete = property(lambda self: bool(self.shards) and all(s.complete for s in self.shards))

    def locate(self, index: int) -> tuple[int, int]:
        """Global sample index -> (position in self.shards, local sample index)."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range: the cache holds {len(self)} committed samples")
        pos = int(np.searchsorted(self._starts, index, side="right") - 1)
        return pos, index - int(self._starts[pos])

    def lengths(self) -> np.ndarray:
        return np.concatenate([np.diff(o) for o in self._offsets]) if self._offsets else np.zeros(0, np.int64)

    def source_indices(self) -> np.ndarray:
        return np.concatenate([np.zeros(0, np.int64), *(self._source(p) for p in range(len(self.shards)))])

    def read_raw(self, index: int, fields: Iterable[str] = TOKEN_FIELDS) -> dict[str, np.ndarray]:
        """One sample's arrays as stored; a corrupted chunk raises CacheError naming it."""
        pos, j = self.locate(index)
        t0, t1 = int(self._offsets[pos][j]), int(self._offsets[pos][j + 1])
        return self._read_span(pos, t0, t1, tuple(fields), f"sample {index} (tokens {t0}:{t1})")

    def _read_span(self, pos: int, t0: int, t1: int, fields: tuple[str, ...], what: str,
                   zarrs: bool = False) -> dict[str, np.ndarray]:
        """Tokens ``t0:t1`` of each array of the shard at ``pos``, as stored; ``what`` names them in an error."""
        arrays = [self._array(pos, f, zarrs).async_array for f in fields]

        async def read_all():  # one trip to zarr's event loop for all arrays: 0.78x the time of one each
            return await asyncio.gather(*(a.getitem(slice(t0, t1)) for a in arrays), return_exceptions=True)

        out = {}
        for f, got in zip(fields, zarr_sync(read_all())):
            if isinstance(got, Exception):
                raise CacheError(f"{self.path}: shard {self.shards[pos].shard_id:05d} {what} array {f}: "
                                 f"cannot read: {type(got).__name__}: {got}") from got
            out[f] = np.asarray(got)
        return out

    def _stored(self, fields: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(the fields asked for, checked; the arrays to read for them)."""
        fields = tuple(fields)
        if unknown := set(fields) - set(TOKEN_FIELDS):
            raise ValueError(f"unknown cache fields {sorted(unknown)}; the cache stores {TOKEN_FIELDS}")
        return fields, fields + ((HIDDEN_SCALE,) if "hidden" in fields and self.spec.codec.lossy else ())

    def _tensors(self, pos: int, j: int, raw: dict[str, np.ndarray], fields: tuple[str, ...], decode: bool) -> dict:
        """``read``'s result from the stored arrays of sample ``j`` of the shard at ``pos``."""
        out = {f: decode_topk_logprobs(self.spec, raw[f]) if f == "topk_logprobs" else
               torch.from_numpy(raw[f].astype(bool if f == "loss_mask" else np.int64)) for f in fields if f != "hidden"}
        if HIDDEN_SCALE in raw and not decode:
            out["hidden"], out[HIDDEN_SCALE] = torch.from_numpy(raw["hidden"]), torch.from_numpy(raw[HIDDEN_SCALE])
        elif "hidden" in fields:  # (T, L, D) bfloat16
            out["hidden"] = decode_hidden(self.spec, raw)
        return {**out, "source_index": int(self._source(pos)[j])}

    def read(self, index: int, fields: Iterable[str] = TOKEN_FIELDS, decode: bool = True) -> dict[str, Any]:
        """One sample's ``fields`` as tensors (``hidden`` (T, L, D) bf16, ``topk_logprobs`` float32) and its
        ``source_index``; ``decode=False`` keeps a lossy payload and ``hidden_scale`` (``decode_hidden`` on a GPU)."""
        fields, stored = self._stored(fields)
        return self._tensors(*self.locate(index), self.read_raw(index, stored), fields, decode)

    def read_many(self, indices: Iterable[int], fields: Iterable[str] = TOKEN_FIELDS, decode: bool = True,
                  span_tokens: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(index, read(index))`` for each of ``indices``, read in spans of ``span_tokens`` tokens or more (default:
        about ``SPAN_BYTES`` as stored; in ascending order each chunk is decoded once, where ``read`` decodes every
        chunk a sample touches). A sample's arrays may be views of its span: copy what is kept."""
        fields, stored = self._stored(fields)
        row_bytes = sum(b for f, b in stored_row_bytes(self.spec).items() if f in stored)
        span_tokens = span_tokens or max(1, SPAN_BYTES // row_bytes)
        span_pos, s0, s1, span = -1, 0, 0, {}  # the span read last: shard position, tokens s0:s1, its arrays
        for index in indices:
            pos, j = self.locate(index)
            t0, t1 = int(self._offsets[pos][j]), int(self._offsets[pos][j + 1])
            if pos != span_pos or t0 < s0 or t1 > s1:  # not inside it: read the span that starts at this sample
                span_pos, s0, s1 = pos, t0, min(max(t1, t0 + span_tokens), self.shards[pos].tokens)
                span = self._read_span(pos, s0, s1, stored, f"tokens {s0}:{s1} (sample {index} on)", zarrs=True)
            yield index, self._tensors(pos, j, {f: a[t0 - s0:t1 - s0] for f, a in span.items()}, fields, decode)

    __getitem__ = read

    def id_counts(self, minlength: int = 0, batch_chunks: int = 16) -> np.ndarray:
        """Occurrences of every token id in the committed ``input_ids``, read ``batch_chunks`` chunks at a time."""
        counts = np.zeros(max(self.spec.vocab_size, minlength), np.int64)
        for pos, shard in enumerate(self.shards):
            step = self._array(pos, "input_ids").chunks[0] * batch_chunks
            for t0 in range(0, shard.tokens, step):
                t1 = min(t0 + step, shard.tokens)
                ids = self._read_span(pos, t0, t1, ("input_ids",), f"tokens {t0}:{t1}")["input_ids"]
                found = np.bincount(ids, minlength=len(counts))  # longer where an id is past the vocabulary
                counts = found + np.pad(counts, (0, len(found) - len(counts)))
        return counts

    def check_compatible(self, *, layer_ids: list[int] | None = None, hidden_size: int | None = None,
                         vocab_size: int | None = None, tokenizer_hash: str | None = None,
                         num_target_layers: int | None = None) -> None:
        """Raise CacheMismatch naming every way this cache cannot serve the request."""
        s, have = self.spec, self.spec.fingerprint.get("tokenizer", {}).get("hash")
        missing = [i for i in layer_ids or () if i not in s.layer_ids]
        problems = [f"layers {missing} are not stored (cache has layer ids {s.layer_ids})"] * bool(missing)
        problems += [f"{what}: cache has {had}, need {need}" for what, need, had in (
            ("hidden size", hidden_size, s.hidden_size), ("vocabulary size", vocab_size, s.vocab_size),
            ("target layer count", num_target_layers, s.num_target_layers)) if need is not None and need != had]
        problems += [f"tokenizer: cache was made with tokenizer hash {have}, need {tokenizer_hash}"] * (
            tokenizer_hash is not None and have != tokenizer_hash)
        problems += ["the cache holds no committed samples"] * (len(self) == 0)
        if problems:
            raise CacheMismatch(f"cache {self.path} is incompatible", problems)

    def layer_slots(self, layer_ids: list[int]) -> list[int]:
        """Positions in ``hidden[:, j]`` of the requested layer ids."""
        self.check_compatible(layer_ids=layer_ids)
        return [self.spec.layer_ids.index(i) for i in layer_ids]
