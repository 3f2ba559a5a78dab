"""Which target layers a drafter reads as context: the one default, and the rules every
choice must follow (extraction, training and export all check with ``check_layer_ids``).

Layer id i is the output of decoder layer i (HF ``hidden_states[i + 1]``). Serving
engines (SGLang, vLLM) capture layer id i as the input of decoder layer i + 1 and
concatenate the captured layers in ascending id order. So the last layer (id L-1) has no
capture point, and ids given out of order would be served in another order than the one
the drafter was trained on: both would load and silently draft wrong tokens.
"""

from __future__ import annotations

DEFAULT_COUNT = 5
"""Target layers fused by the DFlash recipe."""

SERVING_REASON = (
    "serving engines capture layer id i as the input of decoder layer i + 1, so the last layer (id L-1) "
    "cannot be captured, and they concatenate the captured layers in ascending order, so unsorted ids would "
    "be served in another order than the drafter was trained on"
)


def default_layer_ids(num_layers: int, count: int = DEFAULT_COUNT) -> list[int]:
    """``count`` ids spread evenly from 1 to L-3, the DFlash recipe (36 layers -> [1, 9, 17, 25, 33]).

    Small targets, where 1..L-3 holds fewer than ``count`` layers, spread over every
    capturable layer 0..L-2 instead, all of them where there are ``count`` or fewer:
    L=2 -> [0], 3 -> [0, 1], 4 -> [0, 1, 2], 5 -> [0, 1, 2, 3], 6 -> [0, 1, 2, 3, 4],
    7 -> [0, 1, 3, 4, 5], 8 -> [1, 2, 3, 4, 5]. A 1-layer target has no capturable layer
    (ValueError). Sorted, distinct, every id below L-1; spread positions round half up.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    if num_layers < 2:
        raise ValueError(f"a target with {num_layers} decoder layer(s) has no layer a drafter can read: "
                         f"{SERVING_REASON}")
    lo, hi = 1, num_layers - 3
    if hi - lo + 1 < count:
        lo, hi = 0, num_layers - 2
    if hi - lo + 1 <= count:
        return list(range(lo, hi + 1))
    if count == 1:
        return [hi]
    span, steps = hi - lo, count - 1
    return [lo + (2 * j * span + steps) // (2 * steps) for j in range(count)]


def check_layer_ids(ids: list[int], num_layers: int) -> None:
    """Raise ValueError naming every way ``ids`` break the rules for an L-layer target
    (empty, out of range, the last layer L-1, repeated, unsorted), and why they exist."""
    ids = [int(i) for i in ids]
    problems = []
    if not ids:
        problems.append("no layer given (the drafter needs at least one context layer)")
    outside = [i for i in ids if not 0 <= i < num_layers]
    if outside:
        problems.append(f"{outside} outside 0..{num_layers - 1}")
    if num_layers - 1 in ids:
        problems.append(f"{num_layers - 1} is the last layer (L-1)")
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        problems.append(f"{repeated} repeated")
    if ids != sorted(ids):
        problems.append(f"not in ascending order (sorted: {sorted(set(ids))})")
    if problems:
        raise ValueError(f"target layer ids {ids} for a {num_layers}-layer target: " + "; ".join(problems)
                         + f". Ids must be distinct, ascending and below L-1: {SERVING_REASON}")
