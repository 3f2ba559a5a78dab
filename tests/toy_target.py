"""A tiny random Qwen3 causal LM saved with ``save_pretrained``, for tests: loaded back
through ``from_pretrained``, the path a real target takes."""

from __future__ import annotations

from pathlib import Path

import torch


def build_qwen3(
    out_dir: str | Path,
    tokenizer,
    *,
    num_hidden_layers: int = 4,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save a randomly initialised (seeded) tiny Qwen3ForCausalLM plus `tokenizer`.

    Reload with `AutoModelForCausalLM.from_pretrained(path)`, the same path a real
    target takes. The global torch RNG is left untouched.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model = model.to(dtype).eval()

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
