"""Drafter layers initialised from the target's decoder layers (`init_from_target_layers`):
the weights equal the HF model's own modules, bad ids are refused, and a run with it trains,
starts from those weights and exports a drafter that loads."""

from __future__ import annotations

import json

import pytest
import torch

import train_helpers as H
from train_helpers import one_thread  # noqa: F401 - the module's autouse fixture
from dflash.train import checkpoint
from dflash.train.loop import train
from dflash.train.model import DFlashDrafter, DrafterConfig, init_from_target_layers


def drafter_for(target_dir, layers: int) -> DFlashDrafter:
    config = json.loads((target_dir / "config.json").read_text())
    dcfg = DrafterConfig.from_target_config(config, [0, 2], mask_token_id=3, block_size=4, num_hidden_layers=layers)
    torch.manual_seed(0)
    return DFlashDrafter(dcfg)


def assert_layer_is_target_layer(drafter_layer, target_layer) -> None:
    """Module by module against the HF model's own attributes (not by checkpoint names)."""
    pairs = {
        "q_proj": (drafter_layer.self_attn.q_proj, target_layer.self_attn.q_proj),
        "k_proj": (drafter_layer.self_attn.k_proj, target_layer.self_attn.k_proj),
        "v_proj": (drafter_layer.self_attn.v_proj, target_layer.self_attn.v_proj),
        "o_proj": (drafter_layer.self_attn.o_proj, target_layer.self_attn.o_proj),
        "q_norm": (drafter_layer.self_attn.q_norm, target_layer.self_attn.q_norm),
        "k_norm": (drafter_layer.self_attn.k_norm, target_layer.self_attn.k_norm),
        "input_layernorm": (drafter_layer.input_layernorm, target_layer.input_layernorm),
        "post_attention_layernorm": (drafter_layer.post_attention_layernorm, target_layer.post_attention_layernorm),
        "gate_proj": (drafter_layer.mlp.gate_proj, target_layer.mlp.gate_proj),
        "up_proj": (drafter_layer.mlp.up_proj, target_layer.mlp.up_proj),
        "down_proj": (drafter_layer.mlp.down_proj, target_layer.mlp.down_proj),
    }
    for name, (mine, theirs) in pairs.items():
        assert torch.equal(mine.weight, theirs.weight), name
    x = torch.randn(2, 5, target_layer.mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(drafter_layer.mlp(x), target_layer.mlp(x))  # the same function, not only the same numbers


def test_weights_equal_the_target_layers(tiny_target_dir, target):
    drafter = drafter_for(tiny_target_dir, 2)
    untouched = {k: v.clone() for k, v in drafter.state_dict().items()}
    init_from_target_layers(drafter, tiny_target_dir, [3, 1])
    assert_layer_is_target_layer(drafter.layers[0], target.model.layers[3])
    assert_layer_is_target_layer(drafter.layers[1], target.model.layers[1])
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    # the target's layers are not all alike, so the copy really picked the ids asked for
    assert not torch.equal(drafter.layers[0].mlp.up_proj.weight, target.model.layers[1].mlp.up_proj.weight)
    # what has no counterpart in the target keeps its seeded random init
    for name in ("fc.weight", "hidden_norm.weight"):
        assert torch.equal(drafter.state_dict()[name], untouched[name]), name


@pytest.mark.parametrize("ids,problem", [([0], "drafter has 2 layers"), ([0, 4], r"ids \[4\] are not layers"),
                                         ([-1, 0], r"ids \[-1\] are not layers")])
def test_bad_ids_are_refused(tiny_target_dir, ids, problem):
    with pytest.raises(ValueError, match=problem):
        init_from_target_layers(drafter_for(tiny_target_dir, 2), tiny_target_dir, ids)


def test_a_target_of_another_shape_is_refused(tiny_target_dir, tmp_path):
    drafter = drafter_for(tiny_target_dir, 1)
    wide = DrafterConfig.from_dict({**drafter.config.to_dict(), "intermediate_size": drafter.config.intermediate_size * 2})
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight is .* drafter weight layers\.0\.mlp\.gate_proj"):
        init_from_target_layers(DFlashDrafter(wide), tiny_target_dir, [2])


def test_a_run_starts_from_the_target_layers_trains_and_exports(tiny_target_dir, target, tiny_tokenizer, tmp_path):
    from dflash.eval.speculative import load_drafter
    from dflash.train.cli import main

    cache = H.write_pattern_cache(tmp_path / "cache.zarr", tiny_target_dir, tiny_tokenizer, n_samples=12)
    # one step at a negligible learning rate: the checkpoint is (almost) the initial weights
    train(H.tiny_config(cache, tiny_target_dir, tmp_path / "first", max_steps=1, lr=1e-7, num_draft_layers=2,
                        init_from_target_layers=[2, 3]))
    drafter = drafter_for(tiny_target_dir, 2)
    drafter.load_state_dict(checkpoint.load_weights(checkpoint.resolve(tmp_path / "first")))
    for i, j in enumerate([2, 3]):
        theirs = dict(target.model.layers[j].named_parameters())
        for name, mine in drafter.layers[i].named_parameters():
            torch.testing.assert_close(mine, theirs[name], atol=1e-6, rtol=0, msg=f"layers.{i}.{name}")
    # a real run from there: the loss falls, and the export loads back
    run = tmp_path / "run"
    train(H.tiny_config(cache, tiny_target_dir, run, max_steps=20, log_every=1, num_draft_layers=2,
                        init_from_target_layers=[2, 3]))
    losses = [json.loads(line)["loss"] for line in open(run / "metrics.jsonl") if '"kind": "train"' in line]
    assert losses[-1] < losses[0] - 0.3
    main(["export", str(run), "--out", str(tmp_path / "export"), "--dtype", "float32"])
    loaded, config = load_drafter(tmp_path / "export")
    assert config.num_hidden_layers == 2
    final = checkpoint.load_weights(checkpoint.resolve(run))
    assert all(torch.equal(loaded.state_dict()[k], final[k]) for k in final)


def test_a_llama_target_without_qk_norms_leaves_them_at_identity(tmp_path):
    """SmolLM2 is a Llama: its layers have no q/k norms, so the drafter's stay at their ones
    init (identity scaling) while every other weight is the target layer's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    llama.save_pretrained(tmp_path / "llama")
    drafter = drafter_for(tmp_path / "llama", 1)
    init_from_target_layers(drafter, tmp_path / "llama", [2])
    layer, theirs = drafter.layers[0], llama.model.layers[2]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert torch.equal(getattr(layer.self_attn, name).weight, getattr(theirs.self_attn, name).weight), name
    assert torch.equal(layer.mlp.down_proj.weight, theirs.mlp.down_proj.weight)
    assert torch.equal(layer.self_attn.q_norm.weight, torch.ones_like(layer.self_attn.q_norm.weight))
    assert torch.equal(layer.self_attn.k_norm.weight, torch.ones_like(layer.self_attn.k_norm.weight))
