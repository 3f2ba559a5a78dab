"""Export format (the DFlashDraftModel folder SGLang and vLLM load) and the round trip export -> load_exported."""

import json
import shutil

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
    """Every tensor name of the format, written out by hand from the format."""
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


def test_export_goes_over_an_earlier_export_only(tmp_path, tiny_target_dir):
    """A second export replaces the first; a folder holding another config.json (the target's, a training run's,
    one that is not JSON) is refused, every byte of it left as it was."""
    cfg = small_config()
    first, second = DFlashDrafter(cfg), DFlashDrafter(cfg)
    with torch.no_grad():
        second.fc.weight.add_(1.0)
    out = export_drafter(second, cfg, export_drafter(first, cfg, tmp_path / "export"))
    assert torch.equal(load_exported(out)[0].fc.weight, second.fc.weight)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"cache": "c", "drafter": {}}))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    target = shutil.copytree(tiny_target_dir, tmp_path / "target")  # a copy: the shared one must stay whole
    for folder in (target, run, broken):
        before = {p.name: p.read_bytes() for p in folder.iterdir()}
        with pytest.raises(ValueError, match="not a DFlash drafter's"):
            export_drafter(first, cfg, folder)
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


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


# ---------------------------------------------------------------------------- both engines, and the target


def test_eagle_layer_ids_are_the_capture_points(exported):
    """Older vLLM releases read eagle_aux_hidden_state_layer_ids: the input of decoder layer
    i + 1 is the output of layer i, so each id is the DFlash id plus one."""
    _, cfg, out = exported
    data = json.loads((out / "config.json").read_text())
    assert data["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in data["dflash_config"]["target_layer_ids"]]
    assert data["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6, 7, 8]
    data["eagle_aux_hidden_state_layer_ids"] = data["dflash_config"]["target_layer_ids"]  # the off-by-one
    (out / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        load_exported(out)


def target_config(**over):
    from transformers import Qwen3Config

    kw = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              vocab_size=60, num_hidden_layers=10)
    kw.update(over)
    return Qwen3Config(**kw)


def test_check_against_target(tiny_tokenizer):
    from dataclasses import replace
    from types import SimpleNamespace

    from dflash.train.export import check_against_target

    cfg = small_config()
    check_against_target(cfg, target_config(), None)  # no tokenizer: any row inside the vocabulary
    with pytest.raises(ValueError) as info:
        check_against_target(cfg, target_config(hidden_size=64, vocab_size=61, num_hidden_layers=8), None)
    text = str(info.value)
    for needle in ("hidden size: the drafter has 32, the target 64", "vocabulary size: the drafter has 60, the target 61",
                   "num_target_layers: the drafter has 10, the target 8", "7 is the last layer (L-1)"):
        assert needle in text, needle
    with pytest.raises(ValueError, match=r"mask_token_id 59 is outside the target vocabulary \[0, 50\)"):
        check_against_target(cfg, target_config(vocab_size=50), None)
    mask_id = tiny_tokenizer.convert_tokens_to_ids("<|MASK|>")  # the toy tokenizer has one
    assert tiny_tokenizer.convert_ids_to_tokens(mask_id) == "<|MASK|>" and mask_id != 59
    with pytest.raises(ValueError, match=rf"mask_token_id 59 is not the tokenizer's <\|MASK\|> \({mask_id}\)"):
        check_against_target(cfg, target_config(), tiny_tokenizer)
    check_against_target(replace(cfg, mask_token_id=mask_id), target_config(), tiny_tokenizer)
    # a loaded target (evaluation's case): its embedding rows are the vocabulary
    loaded = lambda rows: SimpleNamespace(config=target_config(), get_input_embeddings=lambda: torch.nn.Embedding(rows, 4))
    check_against_target(cfg, loaded(60))
    with pytest.raises(ValueError, match="vocabulary size: the drafter has 60, the target 64"):
        check_against_target(cfg, loaded(64))


def test_serve_commands(tmp_path):
    import shlex

    from dflash.train.export import serve_commands

    cmds = serve_commands(tmp_path / "my drafter", "Qwen/Qwen3-8B", block_size=16)
    vllm = shlex.split(cmds["vllm"])
    assert vllm[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"] and vllm[3] == "--speculative-config"
    spec = json.loads(vllm[4])
    assert spec == {"method": "dflash", "model": str((tmp_path / "my drafter").resolve()), "num_speculative_tokens": 15}
    sglang = shlex.split(cmds["sglang"])
    flags = dict(zip(sglang[3::2], sglang[4::2]))
    assert sglang[:3] == ["python", "-m", "sglang.launch_server"]
    assert flags == {"--model-path": "Qwen/Qwen3-8B", "--speculative-algorithm": "DFLASH",
                     "--speculative-draft-model-path": str((tmp_path / "my drafter").resolve()),
                     "--speculative-num-draft-tokens": "16"}
