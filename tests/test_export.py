"""Export format (DESIGN §2) and the round trip export -> load_exported."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash.train import attention
from dflash.train.export import export_drafter, load_exported
from dflash.train.model import DFlashDrafter, DrafterConfig


def small_config():
    return DrafterConfig(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=60, target_layer_ids=[1, 3, 5, 6, 7], num_target_layers=10,
        mask_token_id=59, num_hidden_layers=3, block_size=4, rope_theta=5e5,
        max_position_embeddings=4096, rms_norm_eps=1e-6,
    )


def format_names(n_layers):
    """Every tensor name of the format, written out from DESIGN §2."""
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(n_layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            names.add(f"layers.{i}.self_attn.{proj}.weight")
        names.add(f"layers.{i}.input_layernorm.weight")
        names.add(f"layers.{i}.post_attention_layernorm.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.add(f"layers.{i}.mlp.{proj}.weight")
    return names


@pytest.fixture
def exported(tmp_path):
    torch.manual_seed(0)
    cfg = small_config()
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    out = export_drafter(drafter, cfg, tmp_path / "drafter")
    return drafter, cfg, out


def test_files_names_and_shapes(exported):
    drafter, cfg, out = exported
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
    assert names == format_names(3)
    assert not any("embed" in n or "lm_head" in n for n in names)
    D = cfg.hidden_size
    assert shapes["fc.weight"] == (D, 5 * D)
    assert shapes["hidden_norm.weight"] == (D,) and shapes["norm.weight"] == (D,)
    assert shapes["layers.2.self_attn.q_proj.weight"] == (4 * 8, D)
    assert shapes["layers.2.self_attn.v_proj.weight"] == (2 * 8, D)
    assert shapes["layers.2.self_attn.k_norm.weight"] == (8,)
    assert shapes["layers.0.mlp.up_proj.weight"] == (48, D)


def test_config_json_fields(exported):
    _, cfg, out = exported
    data = json.loads((out / "config.json").read_text())
    assert data["architectures"] == ["DFlashDraftModel"]
    assert data["model_type"] == "qwen3"
    assert data["block_size"] == 4 and data["num_target_layers"] == 10
    assert data["dflash_config"]["mask_token_id"] == 59
    assert data["dflash_config"]["target_layer_ids"] == [1, 3, 5, 6, 7]
    expect = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=5e5,
        max_position_embeddings=4096, vocab_size=60, hidden_act="silu",
        tie_word_embeddings=False, attention_bias=False, torch_dtype="float32",
    )
    for key, value in expect.items():
        assert data[key] == value, key


def test_config_json_readable_by_transformers(exported):
    from transformers import Qwen3Config

    _, _, out = exported
    hf = Qwen3Config.from_pretrained(out)
    assert hf.num_hidden_layers == 3 and hf.head_dim == 8 and hf.vocab_size == 60


def test_round_trip_outputs_identical(exported):
    drafter, cfg, out = exported
    loaded, loaded_cfg = load_exported(out)
    assert loaded_cfg == cfg
    gen = torch.Generator().manual_seed(1)
    S, B = 10, cfg.block_size
    anchors = torch.tensor([[2, 3, 8]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    mask = attention.dense_mask(anchors, valid, torch.tensor([S]), S, B)
    context = torch.randn(1, S, 5 * cfg.hidden_size, generator=gen)
    embeds = torch.randn(1, 3 * B, cfg.hidden_size, generator=gen)
    pos = (anchors[..., None] + torch.arange(B)).view(1, -1)
    with torch.no_grad():
        want = drafter(context, torch.arange(S), embeds, pos, mask)
        got = loaded(context, torch.arange(S), embeds, pos, mask)
    assert torch.equal(got, want)


def test_bf16_export(tmp_path):
    cfg = small_config()
    out = export_drafter(DFlashDrafter(cfg), cfg, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded, _ = load_exported(out)
    assert loaded.fc.weight.dtype == torch.bfloat16


def test_load_rejects_bad_names_and_shapes(exported):
    _, _, out = exported
    weights = out / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.fc.weight"] = tensors.pop("fc.weight")
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match=r"missing \['fc.weight'\].*unexpected \['model.fc.weight'\]"):
        load_exported(out)
    tensors["fc.weight"] = tensors.pop("model.fc.weight")[:, :-1].contiguous()
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="wrong shapes.*fc.weight"):
        load_exported(out)


def test_load_rejects_foreign_config(exported):
    _, _, out = exported
    data = json.loads((out / "config.json").read_text())
    data["architectures"] = ["Qwen3ForCausalLM"]
    (out / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="DFlashDraftModel"):
        load_exported(out)
    data["architectures"] = ["DFlashDraftModel"]
    del data["dflash_config"]
    (out / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="dflash_config"):
        load_exported(out)
