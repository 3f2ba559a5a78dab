"""The MASK row a run picks: the tokenizer's <|MASK|>, else a padded row, else a special token
that never occurs in the cache's input_ids (a tokenizer that fills the embedding, like
SmolLM2's); --mask-token-id refused where the cache holds it; the choice recorded in the run
and its export. Counts are checked against numpy over the raw cache arrays."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import zarr
from click.testing import CliRunner
from train_helpers import CYCLE, one_thread, write_pattern_cache  # noqa: F401 - one_thread: autouse fixture

from dflash.shared.cache import CacheReader
from dflash.train.cli import cli
from dflash.train.target import load_target_meta, mask_candidates, resolve_mask_token

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>", "<gh_stars>"]
"""ids 0-5, as in SmolLM2: pad, the template's two, then three StarCoder-style tokens chat data never holds."""
FREE_CANDIDATES = [3, 4, 5]
VOCAB = 400  # > max(CYCLE): the pattern cache's ids are rows of the embedding


@pytest.fixture(scope="module")
def filled_target(tmp_path_factory) -> Path:
    """A tiny Qwen3 whose tokenizer (no <|MASK|>) fills all of its embedding rows."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from toy_target import build_qwen3
    from transformers import PreTrainedTokenizerFast

    from dflash.eval.toy_tokenizer import chat_template

    words = SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        extra_special_tokens=SPECIALS[1:2] + SPECIALS[3:])
    tokenizer.chat_template = chat_template(generation_tags=False)
    return build_qwen3(tmp_path_factory.mktemp("filled_target"), tokenizer, num_hidden_layers=4)


def raw_id_counts(cache: Path) -> np.ndarray:
    """Occurrences of every id in every shard's input_ids, read straight from the Zarr arrays."""
    root = zarr.open_group(str(cache), mode="r")
    ids = np.concatenate([np.asarray(root["shards"][name]["input_ids"][:]) for name in root["shards"].group_keys()])
    return np.bincount(ids, minlength=VOCAB)


def test_filled_tokenizer_takes_the_first_free_special_token(filled_target, tmp_path):
    hf_config, tokenizer = load_target_meta(str(filled_target))
    assert len(tokenizer) == hf_config.vocab_size == VOCAB and "<|MASK|>" not in tokenizer.get_vocab()
    assert mask_candidates(tokenizer) == FREE_CANDIDATES  # pad, eos and <|im_start|> (the template's) left out
    cache = write_pattern_cache(tmp_path / "cache", filled_target, tokenizer)
    counts = raw_id_counts(cache)
    assert not counts[SPECIALS.index("<|im_start|>")]  # free too, yet chat data holds it: never chosen
    assert resolve_mask_token(None, tokenizer, VOCAB, CacheReader(str(cache))) == 3 and not counts[3]


def test_a_candidate_in_the_cache_is_passed_over(filled_target, tmp_path):
    _, tokenizer = load_target_meta(str(filled_target))
    cache = write_pattern_cache(tmp_path / "cache", filled_target, tokenizer, samples_per_shard=7,
                                cycle=[3] + CYCLE[1:])
    reader = CacheReader(str(cache))
    counts = raw_id_counts(cache)
    np.testing.assert_array_equal(reader.id_counts(batch_chunks=1), counts)
    expected = next(i for i in FREE_CANDIDATES if counts[i] == 0)
    assert counts[3] > 0 and expected == 4
    assert resolve_mask_token(None, tokenizer, VOCAB, reader) == expected


def test_no_free_candidate_asks_for_the_flag(filled_target, tmp_path):
    _, tokenizer = load_target_meta(str(filled_target))
    cache = write_pattern_cache(tmp_path / "cache", filled_target, tokenizer, cycle=FREE_CANDIDATES + CYCLE[3:])
    assert all(raw_id_counts(cache)[FREE_CANDIDATES])
    with pytest.raises(ValueError, match="pass --mask-token-id"):
        resolve_mask_token(None, tokenizer, VOCAB, CacheReader(str(cache)))


def test_tokenizer_mask_wins(tiny_target_dir, tiny_tokenizer, tmp_path):
    cache = write_pattern_cache(tmp_path / "cache", tiny_target_dir, tiny_tokenizer)
    vocab = load_target_meta(str(tiny_target_dir))[0].vocab_size
    mask = tiny_tokenizer.convert_tokens_to_ids("<|MASK|>")
    assert resolve_mask_token(None, tiny_tokenizer, vocab, CacheReader(str(cache))) == mask


def run_args(cache, target, out, *extra) -> list[str]:
    return ["run", "--cache", str(cache), "--target", str(target), "--out", str(out), "--preset", "tiny",
            "--target-layer-ids", "0,2", "--eval-samples", "2", "--max-steps", "1", *extra]


def test_mask_flag_on_an_id_the_cache_holds_is_refused(filled_target, tmp_path):
    _, tokenizer = load_target_meta(str(filled_target))
    cache = write_pattern_cache(tmp_path / "cache", filled_target, tokenizer)
    taken = CYCLE[0]
    n = int(raw_id_counts(cache)[taken])
    result = CliRunner().invoke(cli, run_args(cache, filled_target, tmp_path / "run", "--mask-token-id", str(taken)))
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"--mask-token-id {taken} occurs {n} times" in result.output
    assert "--mask-token-id 3" in result.output  # the free one suggested
    assert not (tmp_path / "run").exists()


def test_chosen_mask_recorded_in_run_and_export(filled_target, tmp_path):
    _, tokenizer = load_target_meta(str(filled_target))
    cache = write_pattern_cache(tmp_path / "cache", filled_target, tokenizer, n_samples=12, cycle=[3] + CYCLE[1:])
    expected = next(i for i in FREE_CANDIDATES if raw_id_counts(cache)[i] == 0)
    run, export = tmp_path / "run", tmp_path / "export"
    result = CliRunner().invoke(cli, run_args(cache, filled_target, run))
    assert result.exit_code == 0, result.output
    assert json.loads((run / "config.json").read_text())["drafter"]["mask_token_id"] == expected
    state = json.loads(next((run / "checkpoints").glob("step_*/state.json")).read_text())
    assert state["drafter_config"]["mask_token_id"] == expected == state["config"]["drafter"]["mask_token_id"]
    result = CliRunner().invoke(cli, ["export", str(run), "--out", str(export)])
    assert result.exit_code == 0, result.output
    assert json.loads((export / "config.json").read_text())["dflash_config"]["mask_token_id"] == expected
