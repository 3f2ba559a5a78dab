"""The target's config read straight from config.json: the drafter it sizes equals the one
HF's own AutoConfig sizes, incomplete files fall back to AutoConfig, and training's
set-up path no longer imports transformers for a folder without a tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash.train import target as T
from dflash.train.model import DrafterConfig


def _drafter(text: dict) -> DrafterConfig:
    return DrafterConfig.from_target_config(text, [1, 2], 5, block_size=8, num_hidden_layers=1)


def _autoconfig_drafter(folder) -> DrafterConfig:
    from transformers import AutoConfig

    return _drafter(T.text_config(AutoConfig.from_pretrained(folder)))


def _save(folder, config) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)


def test_config_json_sizes_the_same_drafter_as_autoconfig(tmp_path):
    from transformers import LlamaConfig, Qwen3Config

    qwen = tmp_path / "qwen3"
    _save(qwen, Qwen3Config(vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=6,
                            num_attention_heads=6, num_key_value_heads=2, head_dim=24, rope_theta=5e5,
                            rms_norm_eps=1e-5, max_position_embeddings=2048))
    llama = tmp_path / "llama"
    _save(llama, LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024))
    for folder in (qwen, llama):
        fast = T.config_json_text(str(folder))
        if fast is None:  # the file lacks a field: the loader takes AutoConfig, still the same drafter
            assert T.load_target_config(str(folder)) == T.text_config(__import__("transformers").AutoConfig
                                                                      .from_pretrained(folder))
            continue
        assert _drafter(fast) == _autoconfig_drafter(folder)
        assert _drafter(T.load_target_config(str(folder))) == _autoconfig_drafter(folder)
    assert T.config_json_text(str(qwen)) is not None  # the Qwen3 file states everything: no transformers needed


@pytest.mark.parametrize("drop", ["head_dim", "rope", "attention_bias"])
def test_a_config_json_missing_a_field_falls_back_to_autoconfig(tmp_path, drop):
    """Qwen3's class gives head_dim 128 when the file has none, not hidden / heads: reading the
    JSON alone would size another drafter, so such files go through AutoConfig."""
    from transformers import Qwen3Config

    folder = tmp_path / "t"
    _save(folder, Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32))
    raw = json.loads((folder / "config.json").read_text())
    for key in {"head_dim": ["head_dim"], "rope": ["rope_theta", "rope_parameters", "rope_scaling"],
                "attention_bias": ["attention_bias"]}[drop]:
        raw.pop(key, None)
    (folder / "config.json").write_text(json.dumps(raw))
    assert T.config_json_text(str(folder)) is None
    assert _drafter(T.load_target_config(str(folder))) == _autoconfig_drafter(folder)
    if drop == "head_dim":
        assert T.load_target_config(str(folder))["head_dim"] != 64 // 4  # the class default, not hidden/heads


def test_nested_text_config_is_read_from_the_file(tmp_path):
    folder = tmp_path / "mm"
    folder.mkdir()
    text = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "vocab_size": 300,
            "intermediate_size": 128, "head_dim": 16, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096, "attention_bias": False, "initializer_range": 0.02,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    (folder / "config.json").write_text(json.dumps({"model_type": "something_vl", "text_config": text}))
    assert T.load_target_config(str(folder)) == text


_SETUP_WITHOUT_TRANSFORMERS = r"""
import sys
from dflash.shared.cache import CacheReader
from dflash.train.config import tiny
from dflash.train.target import build_drafter_config, check_cache, load_target_meta
cfg = tiny().override(cache=sys.argv[1], target=sys.argv[2], out="unused", mask_token_id=7, target_layer_ids=[0, 2])
reader = CacheReader(cfg.cache)
hf_config, tokenizer = load_target_meta(cfg.target)
dcfg = build_drafter_config(cfg, hf_config, tokenizer, reader.spec)
check_cache(reader, hf_config, tokenizer, dcfg.target_layer_ids)
print(dcfg.hidden_size, "transformers" in sys.modules)
"""


def test_training_setup_does_not_import_transformers(tmp_path, tiny_target_dir, tiny_tokenizer):
    """A target folder without a tokenizer (weights and config only): the set-up path reads
    JSON and never imports transformers (seconds at every start on a slow file system)."""
    import shutil

    from tests.train_helpers import write_pattern_cache

    weights_only = tmp_path / "target"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_target_dir / name, weights_only / name)
    cache = write_pattern_cache(tmp_path / "cache.zarr", tiny_target_dir, tiny_tokenizer, n_samples=4)
    out = subprocess.run([sys.executable, "-c", _SETUP_WITHOUT_TRANSFORMERS, str(cache), str(weights_only)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    hidden, imported = out.stdout.split()
    assert int(hidden) == json.loads((tiny_target_dir / "config.json").read_text())["hidden_size"]
    assert imported == "False", "training's set-up imported transformers"
