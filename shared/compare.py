"""How far a converted cache's values are from its source's: the relative L2 error per layer
of the hidden states (and of the top-k log-probs), as training reads both (decoded to bf16
and float32), over the samples ``dflash-cache stats`` draws."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dflash.shared.cache import CacheError, CacheReader
from dflash.shared.convert import fingerprint_digest


def _same_samples(reader: CacheReader, source: CacheReader) -> None:
    """Raise CacheError unless both caches hold the same samples (rows and lengths) in the same order."""
    what = [("samples", len(reader), len(source))]
    if len(reader) == len(source):
        what += [("source rows", reader.source_indices(), source.source_indices()),
                 ("sample lengths", reader.lengths(), source.lengths())]
    for name, ours, theirs in what:
        if not np.array_equal(ours, theirs):
            raise CacheError(f"{source.path} does not hold the samples of {reader.path} ({name} differ): it is not "
                             "the cache it was converted from")


def conversion_error(reader: CacheReader, indices: np.ndarray, against: str | None = None,
                     storage_options: dict | None = None) -> dict[str, Any] | None:
    """Relative L2 error ``||x - x_src|| / ||x_src||`` per layer of the hidden states of samples
    ``indices`` against those of the cache they were converted from (``against``, else the source
    recorded at conversion), with the largest absolute error; the same for the top-k log-probs.
    None for a cache that records no source when none is given; a recorded source that cannot be
    opened is reported (``unavailable``), a given one raises."""
    record = (reader.spec.info or {}).get("converted_from")
    if against is None and not record:
        return None
    where = against or record["path"]
    try:
        source = CacheReader(where, storage_options)
    except CacheError as e:
        if against is not None:
            raise
        return {"against": where, "unavailable": f"the recorded source cannot be opened ({e}); pass --against SRC"}
    if not reader.complete:
        return {"against": where, "unavailable": f"{reader.path} is not complete (a conversion that stopped midway? "
                                                  "rerun it to finish)"}
    _same_samples(reader, source)
    missing = [lid for lid in reader.spec.layer_ids if lid not in source.spec.layer_ids]
    if missing:
        raise CacheError(f"{where} does not store layers {missing} of {reader.path}")
    slots = [source.spec.layer_ids.index(lid) for lid in reader.spec.layer_ids]
    fields = ("input_ids", "hidden", "topk_ids", "topk_logprobs")
    L = reader.spec.num_layers
    err2, ref2, worst = np.zeros(L), np.zeros(L), np.zeros(L)
    tk_err2 = tk_ref2 = tk_worst = 0.0
    tokens = 0
    for i in indices:
        ours, theirs = reader.read(int(i), fields), source.read(int(i), fields)
        if not (torch.equal(ours["input_ids"], theirs["input_ids"]) and torch.equal(ours["topk_ids"], theirs["topk_ids"])):
            raise CacheError(f"sample {int(i)}: token ids or top-k ids differ between {reader.path} and {where}")
        x, ref = ours["hidden"].double(), theirs["hidden"][:, slots].double()  # (T, L, D)
        diff = x - ref
        err2 += (diff * diff).sum(dim=(0, 2)).numpy()
        ref2 += (ref * ref).sum(dim=(0, 2)).numpy()
        worst = np.maximum(worst, diff.abs().amax(dim=(0, 2)).numpy()) if diff.numel() else worst
        p, q = ours["topk_logprobs"].double(), theirs["topk_logprobs"].double()
        tk_err2 += float(((p - q) ** 2).sum())
        tk_ref2 += float((q * q).sum())
        tk_worst = max(tk_worst, float((p - q).abs().max())) if p.numel() else tk_worst
        tokens += len(x)
    rel = lambda e, r: float(np.sqrt(e / r)) if r > 0 else None  # noqa: E731
    return {
        "against": where, "recorded_source": record["path"] if record else None,
        "source_matches_record": None if not record else record["fingerprint_digest"] == fingerprint_digest(
            source.spec.fingerprint),
        "samples": len(indices), "tokens": tokens,
        "layers": [{"layer_id": lid, "rel_l2": rel(err2[j], ref2[j]), "max_abs_error": float(worst[j])}
                   for j, lid in enumerate(reader.spec.layer_ids)],
        "topk_logprobs": {"rel_l2": rel(tk_err2, tk_ref2), "max_abs_error": tk_worst},
        "topk_reduced": reader.spec.topk_dtype != source.spec.topk_dtype,
    }
