"""Shared pytest fixtures. Heavy artefacts (tokenizers, tiny models) are built once per
session under a session temp dir; tests must treat them as read-only."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / "data"


# --- tiny tokenizer (dflash.eval.toy_tokenizer) and target (toy_target) -------------


def _toy_corpus():
    from dflash.eval.toy_tokenizer import default_corpus

    return default_corpus() + [DATA_DIR / "chats_sample.jsonl"]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A 512-token byte-level BPE whose ChatML template has `{% generation %}` tags."""
    from dflash.eval.toy_tokenizer import build_tokenizer

    out = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tokenizer(out, generation_tags=True, corpus=_toy_corpus())
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer_notags_dir(tmp_path_factory) -> Path:
    """Same tokenizer and template, but without generation tags (like Qwen3's real one)."""
    from dflash.eval.toy_tokenizer import build_tokenizer

    out = tmp_path_factory.mktemp("tiny_tokenizer_notags")
    build_tokenizer(out, generation_tags=False, corpus=_toy_corpus())
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    """The tagged tokenizer, loaded back through AutoTokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer_notags(tiny_tokenizer_notags_dir):
    """The untagged tokenizer, loaded back through AutoTokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_notags_dir)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A random 4-layer, 64-wide Qwen3ForCausalLM (fp32, seed 0) plus the tagged tokenizer.

    Load with `AutoModelForCausalLM.from_pretrained(tiny_target_dir)`.
    """
    from toy_target import build_qwen3

    return build_qwen3(tmp_path_factory.mktemp("tiny_target"), tiny_tokenizer)


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    """The tiny target loaded through `from_pretrained` (fp32, eval mode); torch set to one
    thread, as tiny matmuls only add contention on shared CI cores."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


# --- sample datasets ---------------------------------------------------------------


@pytest.fixture(scope="session")
def chats_sample_path() -> Path:
    """data/chats_sample.jsonl: 40 generated chats in `messages` format."""
    return DATA_DIR / "chats_sample.jsonl"


@pytest.fixture(scope="session")
def chats_sharegpt_sample_path() -> Path:
    """data/chats_sharegpt_sample.jsonl: 10 generated chats in ShareGPT format."""
    return DATA_DIR / "chats_sharegpt_sample.jsonl"
