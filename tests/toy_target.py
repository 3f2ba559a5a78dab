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


def fit_drafter(target, config, prompts: list[list[int]], new_tokens: int, steps: int = 40, seed: int = 0):
    """A DFlashDrafter fitted for ``steps`` Adam steps (training's forward and loss, dense
    attention) to the target's greedy continuations of ``prompts``: on a tiny target its
    blocks then accept anywhere from 1 to B tokens, which an untrained drafter's never do."""
    from dflash.eval import replay_eval as rp
    from dflash.extract.target import TargetRunner
    from dflash.train.data import Collate, candidate_anchors
    from dflash.train.model import DFlashDrafter, TargetHead
    from dflash.train.step import StepSpec, forward_loss

    device = next(target.parameters()).device
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = DFlashDrafter(config).to(device)
    runner = TargetRunner(target, list(config.target_layer_ids), topk=1)
    samples = rp.replay_samples(runner, prompts, rp.greedy_continuations(target, prompts, new_tokens, []),
                                frozenset())
    runner.close()
    items = []
    for s in samples:
        anchors = candidate_anchors(s["loss_mask"].cpu())
        items.append({k: v.cpu() for k, v in s.items() if isinstance(v, torch.Tensor)}
                     | {"anchors": torch.nn.functional.pad(anchors, (0, new_tokens - len(anchors))),
                        "block_valid": torch.arange(new_tokens) < len(anchors)})
    batch = {k: v.to(device) for k, v in Collate(None)(items).items()}
    spec = StepSpec("dense", config.block_size, config.mask_token_id, None, 4096, None)
    head = TargetHead(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        forward_loss(drafter, head, batch, spec).loss.backward()
        opt.step()
    return drafter.eval()
