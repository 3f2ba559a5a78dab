"""Regenerate a chat dataset's assistant turns with the target itself (README.md, "Before stage one"), in process
(`LocalEngine`) or through a server (`regenerate_endpoint`), in resumable parts of `part_size` rows (`part_paths`)."""

from __future__ import annotations

import datetime
import itertools
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflash.shared.cli import check_choices

from .chat import check_template_kwargs, stop_token_ids
from .data import Conversation, DataError, SkipCounter, dataset_fingerprint, guard, load_source, normalize_row
from .regenerate_endpoint import EndpointEngine, answer_event, wire_message

FORMAT_VERSION = 1
RUN_FILE = "run.json"
# source rows per part: a server's answers are journaled; in process an unfinished part is redone (BENCHMARKS_LOG)
PART_SIZE = {"endpoint": 256, "in process": 4096}
BATCH_SIZE = {"cuda": 512, "cpu": 16}  # in process (BENCHMARKS.md, "Regeneration on the GPU")
METADATA_FILE = "regenerate.json"
PARTS_DIR = "parts"
TOTALS = ("turns_regenerated", "truncated_turns", "generated_tokens")  # counted per chat, summed per part and run


@dataclass
class GenerationSettings:
    """How the target answers: everything that changes the generated text (fields: regenerate_cli.py's help)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 1024
    max_prompt_tokens: int | None = None
    drop_truncated: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"


@dataclass
class RegenConfig:
    """One regeneration job (fields: regenerate_cli.py's help)."""

    data: str
    model: str | None  # with ``endpoint``: the served model's name (None: the one model the server lists)
    out: str
    split: str = "train"
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    endpoint: str | None = None  # the server's base URL; None: the target in this process
    api_key: str | None = None
    request_timeout: float = 600.0
    retries: int = 6
    retry_wait: float = 1.0  # first backoff in seconds (no flag)
    concurrency: int = 32
    extra_body: dict[str, Any] = field(default_factory=dict)
    batch_size: int | None = None  # None: BATCH_SIZE by the target's device
    part_size: int | None = None  # None: PART_SIZE[engine]
    limit: int | None = None
    device: str = "cpu"
    static_cache: bool | None = None
    on_bad_row: Literal["skip", "error"] = "skip"
    progress: bool = True  # a tqdm bar over source rows (no flag)

    def validate(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        check_choices(self)
        values = {**vars(self), **vars(self.generation)}
        for names, ok, want in (
                ("temperature", lambda v: v >= 0, "0 or more"), ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
                ("max_new_tokens max_prompt_tokens batch_size concurrency part_size limit",
                 lambda v: v is None or v >= 1, "at least 1")):
            for name in names.split():
                if not ok(values[name]):
                    raise ValueError(f"{name} must be {want}, got {values[name]}")
        check_template_kwargs(self.generation.template_kwargs)
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"--endpoint {self.endpoint}: give the server's base URL, e.g. http://HOST:8000/v1")
        if self.endpoint is None and self.model is None:
            raise ValueError("give --model (in process) or --endpoint (a server)")


@dataclass
class Chat:
    conv: Conversation
    messages: list[dict]
    answered: int = 0  # the messages before this index are done
    turns_regenerated: int = 0
    truncated_turns: int = 0
    generated_tokens: int = 0
    dropped: str | None = None  # skip reason, when the whole row is dropped

    @classmethod
    def start(cls, conv: Conversation, counts: SkipCounter) -> Chat:
        """A chat ready for its first turn; leading assistant messages (no prompt to answer) removed, counted."""
        leading = next((i for i, m in enumerate(conv.messages) if m["role"] != "assistant"), len(conv.messages))
        if leading:
            counts.counts["leading_assistant_removed"] += 1
        chat = cls(conv, conv.messages[leading:])
        if chat.next_turn is None:
            chat.dropped = "no_assistant_turn"
        return chat

    @property
    def next_turn(self) -> int | None:
        """The index of the next assistant message to regenerate; None when done or dropped."""
        return None if self.dropped else next((i for i in range(self.answered, len(self.messages))
                                               if self.messages[i]["role"] == "assistant"), None)

    def apply(self, event: dict, skips: SkipCounter) -> None:
        """A turn's event (``answer_event``): its new message in place, or a cut there (the messages before it kept;
        the row dropped when no assistant turn survives)."""
        turn = event["turn"]
        if "cut" not in event:
            self.messages[turn], self.answered = event["message"], turn + 1
            self.turns_regenerated += 1
            self.truncated_turns += int(event["truncated"])
            self.generated_tokens += event["tokens"]
            return
        self.messages = self.messages[:turn]
        if any(m["role"] == "assistant" for m in self.messages):
            skips.counts[f"cut_{event['cut']}"] += 1
        else:
            self.dropped = event["cut"]


def read_journal(path: Path) -> list[dict]:
    """A part's journaled turns (JSON lines). A last line without its newline was torn by a kill mid-write, even where
    it parses (the next append would join it): it is cut off the file, and its turn asked again."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    *lines, torn = text.split("\n")  # not splitlines(): an answer's JSON string may hold U+2028 and such, unescaped
    if torn:
        path.write_text(text[: len(text) - len(torn)], encoding="utf-8")
    events = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {number} is not JSON ({err}); delete the file to redo that part") from err
    return events


@dataclass
class Part:
    """One part being regenerated: its chats as far as its turn journal got."""

    index: int
    rows: int  # source rows it covers
    chats: list[Chat]
    skips: SkipCounter
    journal: Path
    shown: int = 0  # rows the progress bar counted
    models: Counter = field(default_factory=Counter)  # answers per served model

    def apply(self, chat: Chat, event: dict, *, journal: bool = False) -> None:
        """A turn's event applied to its chat; with ``journal``, journaled first."""
        if journal:  # closed at once: in the OS's hands, it survives a kill of this process
            with self.journal.open("a", encoding="utf-8") as file:
                file.write(json.dumps(event, ensure_ascii=False) + "\n")
        if event["turn"] != chat.next_turn:
            raise ValueError(f"{self.journal}: row {chat.conv.row_index} does not match the source (turn "
                             f"{event['turn']}, expected {chat.next_turn}); delete the file to redo the part")
        chat.apply(event, self.skips)
        if "model" in event:  # a server's answer
            self.models[event["model"]] += 1


def open_part(out: Path, index: int, rows: int, convs: list[Conversation], skips: SkipCounter) -> Part:
    """Start a part's chats and replay its journal onto them."""
    part = Part(index, rows, [Chat.start(conv, skips) for conv in convs], skips, part_paths(out, index)[2])
    by_row = {chat.conv.row_index: chat for chat in part.chats}
    for event in read_journal(part.journal):
        if event.get("row") not in by_row:
            raise ValueError(f"{part.journal}: row {event.get('row')} is not a conversation of this part; "
                             "delete the file to redo the part")
        part.apply(by_row[event["row"]], event)
    return part


def chat_totals(chats: list[Chat]) -> dict[str, int]:
    """The ``TOTALS`` summed over the chats not dropped: a part's record, and the regeneration benchmark's."""
    return {key: sum(getattr(chat, key) for chat in chats if not chat.dropped) for key in TOTALS}


def finish_part(out: Path, part: Part) -> None:
    """Write the part's rows, then its done record (which marks it finished), then drop its journal."""
    rows = []
    for chat in part.chats:
        if chat.dropped:
            if chat.dropped != "template_rejected":  # already recorded with its message
                part.skips.record(DataError(chat.dropped, chat.conv.source, chat.conv.row_index,
                                            f"no assistant turn left ({chat.dropped})"))
            continue
        row = {"messages": [wire_message(m) for m in chat.messages], "source_row": chat.conv.row_index,
               "truncated_turns": chat.truncated_turns}
        rows.append({**row, "tools": chat.conv.tools} if chat.conv.tools else row)
    stats = {"part": part.index, "rows_in": part.rows, "rows_out": len(rows), "skipped": part.skips.to_dict(),
             **chat_totals(part.chats), **({"served_models": dict(part.models)} if part.models else {})}
    data_path, done_path, _ = part_paths(out, part.index)
    _write_atomic(data_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    _write_atomic(done_path, json.dumps(stats, indent=2, sort_keys=True) + "\n")
    part.journal.unlink(missing_ok=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def part_chats(ds, start: int, stop: int, source: str, on_bad_row: str, skips: SkipCounter) -> list[Conversation]:
    """The chats of source rows [start, stop); bad rows and text rows counted in `skips` (or raised)."""
    convs = []
    for index in range(start, stop):
        conv = guard(on_bad_row, skips, normalize_row, ds[index], index, source)
        if conv is not None and conv.kind != "chat":
            skips.record(DataError("text_row", source, index, "plain text row: no assistant turn to regenerate"))
        elif conv is not None:
            convs.append(conv)
    return convs


def part_paths(out: Path, index: int) -> tuple[Path, Path, Path]:
    """A part's rows, its done record and its turn journal."""
    base = out / PARTS_DIR / f"part-{index:05d}"
    return base.with_suffix(".jsonl"), base.with_suffix(".done.json"), base.with_suffix(".turns.jsonl")


def generation_kwargs(settings: GenerationSettings, stop_ids: list[int], pad_id: int | None) -> dict[str, Any]:
    """generate() arguments that leave nothing to the model's generation_config; no ``pad_id`` (a tokenizer without
    a pad token): the first stop token pads (masked either way)."""
    pad_id = stop_ids[0] if pad_id is None else pad_id
    kwargs: dict[str, Any] = dict(max_new_tokens=settings.max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id,
                                  num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0, do_sample=False)
    if settings.temperature > 0:
        kwargs.update(do_sample=True, temperature=settings.temperature, top_p=settings.top_p, top_k=0, min_p=0.0,
                      typical_p=1.0)
    return kwargs


STATIC_PROMPT_TOKENS = 2048  # the static caches' room for a prompt when --max-prompt-tokens is not set
STATIC_SMALLEST_ROOM = 256  # rooms double from here up to the prompt cap
GROUPED_DECODE = "grouped_kv_decode"  # no "flash" in the name: transformers would fetch such a kernel from the hub


def grouped_decode_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' SDPA attention, except that a one-token query over grouped key/value heads runs on the cache as it
    is, as (batch, key/value heads, group, dim), instead of copying the keys and values to every query head."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    batch, heads, _, dim = query.shape
    out = F.scaled_dot_product_attention(query.reshape(batch, heads // groups, groups, dim), key, value,
                                         attn_mask=attention_mask, scale=scaling)  # mask (batch, 1, 1, keys)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


class StaticDecoder:
    """Static KV caches of (batch_size, room + max_new_tokens) per doubling prompt room, on which generate() compiles
    and captures the decode step; an SDPA model decodes through ``grouped_decode_attention``."""

    def __init__(self, model, batch_size: int, max_new_tokens: int, prompt_tokens: int | None):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        self.model, self.rows, self.max_new_tokens = model, batch_size, max_new_tokens
        self.room = prompt_tokens or STATIC_PROMPT_TOKENS
        self.caches: dict[int, object] = {}
        AttentionInterface.register(GROUPED_DECODE, grouped_decode_attention)
        AttentionMaskInterface.register(GROUPED_DECODE, sdpa_mask)
        if model.config._attn_implementation == "sdpa":
            model.set_attn_implementation(GROUPED_DECODE)

    def cache_for(self, width: int, rows: int):
        """The reset cache of the smallest room that holds ``width`` prompt tokens, or None."""
        if width > self.room or rows > self.rows:
            return None
        room = min(self.room, max(STATIC_SMALLEST_ROOM, 1 << (width - 1).bit_length()))  # the power of 2 >= width
        if room not in self.caches:
            from transformers import StaticCache

            self.caches[room] = StaticCache(config=self.model.config, max_cache_len=room + self.max_new_tokens)
        return self.caches[room]


def generate_batch(model, prompts: list[list[int]], gen_kwargs: dict, stop_ids: list[int],
                   static: StaticDecoder | None = None) -> list[tuple[list[int], bool]]:
    """Left-padded batched generation of token-id prompts: per prompt (tokens before the stop token,
    truncated?). On ``static``'s cache the batch is padded to its rows with copies of the first prompt (masked)."""
    import torch

    encoded = [list(ids) for ids in prompts]
    width, real_rows = max(len(ids) for ids in encoded), len(encoded)
    cache = static.cache_for(width, real_rows) if static is not None else None
    with torch.inference_mode():
        if cache is not None:
            encoded += [encoded[0]] * (static.rows - real_rows)
            cache.reset()
            gen_kwargs = {**gen_kwargs, "past_key_values": cache}
        input_ids = torch.tensor([[gen_kwargs["pad_token_id"]] * (width - len(ids)) + ids for ids in encoded])
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded])
        out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                             **gen_kwargs)
    results = []
    for tokens in out[:real_rows, width:].tolist():
        cut = next((i for i, t in enumerate(tokens) if t in stop_ids), None)
        results.append((tokens, True) if cut is None else (tokens[:cut], False))
    return results


def batch_priority(item: tuple[Chat, int, list[int]]) -> tuple[int, int]:
    """Which ready (chat, turn, prompt ids) runs first: the chat with the most turns left (the deepest chats set how
    many batches there are), then the longest prompt."""
    chat, turn, ids = item
    return -sum(m["role"] == "assistant" for m in chat.messages[turn:]), -len(ids)


def regenerate_conversations(model, tokenizer, chats: list[Chat], settings: GenerationSettings, batch_size: int,
                             skips: SkipCounter, static: StaticDecoder | None = None, done=None,
                             batches: list[dict] | None = None) -> None:
    """Regenerate every assistant turn of ``chats`` in place, batches from a pool of ready turns by ``batch_priority``;
    ``done(chat)`` hears of each finished chat; ``batches`` gets each batch's rows, width, steps, tokens, seconds."""
    stop_ids = stop_token_ids(model, tokenizer, settings.template_kwargs)
    gen_kwargs = generation_kwargs(settings, stop_ids, tokenizer.pad_token_id)
    pool: list[tuple[Chat, int, list[int]]] = []  # (chat, turn, prompt ids)

    def ready(chat: Chat) -> None:
        """The chat's next turn into the pool, or, with none left, the chat to ``done``."""
        turn = chat.next_turn
        if turn is not None:
            try:
                text = tokenizer.apply_chat_template(chat.messages[:turn], add_generation_prompt=True, tokenize=False,
                                                     **settings.template_kwargs)
            except Exception as exc:  # noqa: BLE001 - jinja errors, raise_exception()
                skips.record(DataError("template_rejected", chat.conv.source, chat.conv.row_index,
                                       f"chat template rejected the prompt: {type(exc).__name__}: {exc}"))
                chat.dropped = "template_rejected"
            else:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                if settings.max_prompt_tokens is None or len(ids) <= settings.max_prompt_tokens:
                    pool.append((chat, turn, ids))
                    return
                chat.apply({"turn": turn, "cut": "prompt_too_long"}, skips)
        if done is not None:
            done(chat)

    for chat in chats:
        ready(chat)
    while pool:
        pool.sort(key=batch_priority)
        batch, pool[:] = pool[:batch_size], pool[batch_size:]
        started = time.perf_counter()
        outputs = generate_batch(model, [ids for _, _, ids in batch], gen_kwargs, stop_ids, static)
        if batches is not None:  # a row's steps: its tokens and the stop token, unless cut at max_new_tokens
            batches.append({"rows": len(batch), "width": max(len(ids) for *_, ids in batch),
                            "steps": max(len(tokens) + (not truncated) for tokens, truncated in outputs),
                            "tokens": sum(len(tokens) for tokens, _ in outputs),
                            "seconds": round(time.perf_counter() - started, 3)})
        for (chat, turn, _), (tokens, truncated) in zip(batch, outputs):
            content = tokenizer.decode(tokens, skip_special_tokens=False)
            chat.apply(answer_event(chat, turn, settings, content, truncated, len(tokens)), skips)
            ready(chat)


class LocalEngine:
    """The target in this process: batched generate(), on static KV caches on CUDA."""

    def __init__(self, cfg: RegenConfig, model=None, tokenizer=None):
        from transformers import AutoTokenizer

        from dflash.shared.fingerprint import target_fingerprint, tokenizer_fingerprint

        from .target import load_target

        gen = cfg.generation
        tokenizer = AutoTokenizer.from_pretrained(cfg.model) if tokenizer is None else tokenizer
        model = load_target(cfg.model, dtype=gen.dtype, device=cfg.device) if model is None else model
        self.cfg, self.model, self.tokenizer, self.batches = cfg, model, tokenizer, []
        room = getattr(model.config, "max_position_embeddings", None)  # None: a model without a position limit
        if room and gen.max_new_tokens + (gen.max_prompt_tokens or 1) > room:  # past it, positions the target never saw
            raise ValueError(f"--max-new-tokens {gen.max_new_tokens} after a prompt of {gen.max_prompt_tokens or 1} "
                             f"(--max-prompt-tokens) runs past the target's {room} positions (max_position_embeddings)")
        self.batch_size = cfg.batch_size or BATCH_SIZE.get(model.device.type, BATCH_SIZE["cpu"])
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.fingerprint = target_fingerprint(cfg.model, model.config.to_dict(), dtype)
        self.record = {"generation": asdict(gen), "tokenizer": tokenizer_fingerprint(tokenizer),
                       "target": dict(self.fingerprint)}
        use_static = cfg.static_cache if cfg.static_cache is not None else model.device.type == "cuda"
        self.static = (StaticDecoder(model, self.batch_size, gen.max_new_tokens, gen.max_prompt_tokens)
                       if use_static else None)

    def metadata(self, stats: list[dict]) -> dict:
        return {"target_fingerprint": self.fingerprint, "batches_this_process": self.batches}

    def run(self, parts, finish, progress) -> None:
        for part in parts:
            regenerate_conversations(self.model, self.tokenizer, part.chats, self.cfg.generation, self.batch_size,
                                     part.skips, self.static, done=lambda chat, part=part: progress(part, chat),
                                     batches=self.batches)
            finish(part)


def start_run(out: Path, record: dict, overwrite: bool) -> None:
    """Make ``out`` (emptied first with ``overwrite``); write its run record, or check it on a resume."""
    if overwrite and out.exists():
        shutil.rmtree(out)
    (out / PARTS_DIR).mkdir(parents=True, exist_ok=True)
    path, record = out / RUN_FILE, json.loads(json.dumps(record))
    if not path.exists():
        return _write_atomic(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    previous = json.loads(path.read_text())
    if previous != record:
        diff = sorted(k for k in set(previous) | set(record) if previous.get(k) != record.get(k))
        raise ValueError(f"{out} was started with different settings or inputs (differs in: {', '.join(diff)}); "
                         "use another --out or --overwrite")


def regenerate(cfg: RegenConfig, *, model=None, tokenizer=None, overwrite: bool = False,
               max_parts: int | None = None) -> dict[str, Any] | None:
    """Run (or resume) the job; returns the metadata once every part is done. ``model``/``tokenizer``:
    already loaded (in process); ``max_parts``: stop after that many new parts, returning None."""
    import torch
    from tqdm.auto import tqdm

    cfg.validate()
    ds = load_source(cfg.data, cfg.split)
    num_rows, source_fp = min(len(ds), cfg.limit or len(ds)), dataset_fingerprint(ds, cfg.data, cfg.split)
    engine = LocalEngine(cfg, model, tokenizer) if cfg.endpoint is None else EndpointEngine(cfg)
    # everything that decides the output rows: a resume must match it exactly
    size = cfg.part_size or PART_SIZE["endpoint" if cfg.endpoint else "in process"]
    record = {"format": FORMAT_VERSION, "part_size": size, "num_rows": num_rows, "on_bad_row": cfg.on_bad_row,
              "source": {k: source_fp.get(k) for k in ("source", "split", "revision", "num_rows", "hash_method",
                                                       "content_hash")}, **engine.record}
    out = Path(cfg.out)
    start_run(out, record, overwrite)
    spans = [(start, min(num_rows, start + size)) for start in range(0, num_rows, size)]  # each part's rows
    bar = tqdm(total=num_rows, desc="regenerate", unit="row", disable=not cfg.progress)

    def parts():
        """The parts not done yet, their chats started."""
        for index, (start, stop) in enumerate(spans):
            if part_paths(out, index)[1].exists():
                bar.update(stop - start)
                continue
            skips = SkipCounter()
            torch.manual_seed(cfg.generation.seed * 1_000_003 + index)  # in process: the part's sampling
            convs = part_chats(ds, start, stop, cfg.data, cfg.on_bad_row, skips)
            yield open_part(out, index, stop - start, convs, skips)

    def finish(part: Part) -> None:
        finish_part(out, part)
        bar.update(part.rows - part.shown)

    generated, started = 0, time.monotonic()

    def progress(part: Part, chat: Chat) -> None:
        """A chat of ``part`` is done: one row more on the bar, and the tokens generated per second so far."""
        nonlocal generated
        generated += chat.generated_tokens
        part.shown += 1
        bar.set_postfix_str(f"{generated / max(time.monotonic() - started, 1e-9):,.0f} tok/s", refresh=False)
        bar.update(1)

    try:
        engine.run(itertools.islice(parts(), max_parts), finish, progress)
    finally:
        bar.close()
    if all(part_paths(out, index)[1].exists() for index in range(len(spans))):
        return finalize(out, len(spans), record, source_fp, engine)
    return None


def finalize(out: Path, num_parts: int, record: dict, source_fp: dict, engine) -> dict[str, Any]:
    """Gather every part into one saved dataset under ``out`` and write the metadata."""
    import datasets
    import torch
    import transformers

    stats = [json.loads(part_paths(out, p)[1].read_text()) for p in range(num_parts)]
    files = [str(part_paths(out, p)[0]) for p, s in enumerate(stats) if s["rows_out"] > 0]
    if not files:
        raise ValueError("regeneration produced no rows (see the skip counts in the part records)")
    for old in out.glob("data-*.arrow"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix=".finalize-", dir=out, ignore_cleanup_errors=True) as scratch:
        datasets.load_dataset("json", data_files=files, split="train", cache_dir=scratch).save_to_disk(str(out))
    counts: dict[str, Any] = {key: sum(s[key] for s in stats) for key in ("rows_in", "rows_out", *TOTALS)}
    counts["skipped"] = dict(sorted(sum((Counter(s["skipped"]) for s in stats), Counter()).items()))
    metadata = {**record, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "source_fingerprint": source_fp, "counts": counts, "parts": num_parts,
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                             "datasets": datasets.__version__},
                "read_with": "dflash.extract.data.load_source(OUT)", **engine.metadata(stats)}
    _write_atomic(out / METADATA_FILE, json.dumps(metadata, indent=2, sort_keys=True) + "\n")
    return metadata
