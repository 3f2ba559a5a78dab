"""Which target layers a drafter reads as context: the one default, and the rules every choice must follow
(extraction, training and export all check with ``check_layer_ids``). Layer id i is the output of decoder layer i
(HF ``hidden_states[i + 1]``)."""

from __future__ import annotations

DEFAULT_COUNT = 5  # target layers fused by the DFlash recipe

SERVING_REASON = ("serving engines capture layer id i as the input of decoder layer i + 1, so the last layer (id L-1) "
                  "cannot be captured, and they concatenate the captured layers in ascending order, so unsorted ids "
                  "would be served in another order than the drafter was trained on")


def default_layer_ids(num_layers: int, count: int = DEFAULT_COUNT) -> list[int]:
    """``count`` ids spread evenly from 1 to L-3, the DFlash recipe (36 layers -> [1, 9, 17, 25, 33]; spread
    positions round half up). Where 1..L-3 holds fewer than ``count`` layers, over every capturable layer 0..L-2
    instead (all of them where there are ``count`` or fewer); a 1-layer target has none (ValueError)."""
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
    outside = [i for i in ids if not 0 <= i < num_layers]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    problems = [text for broken, text in (
        (not ids, "no layer given (the drafter needs at least one context layer)"),
        (outside, f"{outside} outside 0..{num_layers - 1}"),
        (num_layers - 1 in ids, f"{num_layers - 1} is the last layer (L-1)"),
        (repeated, f"{repeated} repeated"),
        (ids != sorted(ids), f"not in ascending order (sorted: {sorted(set(ids))})"),
    ) if broken]
    if problems:
        raise ValueError(f"target layer ids {ids} for a {num_layers}-layer target: " + "; ".join(problems)
                         + f". Ids must be distinct, ascending and below L-1: {SERVING_REASON}")
