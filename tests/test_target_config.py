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


_SETUP = r"""
import sys
from dflash.shared.cache import CacheReader
from dflash.train.config import tiny
from dflash.train.target import build_drafter_config, check_cache, load_target_meta
cfg = tiny().override(cache=sys.argv[1], target=sys.argv[2], out="unused", target_layer_ids=[0, 2], mask_token_id=7)
reader = CacheReader(cfg.cache)
hf_config, tokenizer = load_target_meta(cfg.target, sys.argv[3] if len(sys.argv) > 3 else None)
dcfg = build_drafter_config(cfg, hf_config, tokenizer, reader.spec)
check_cache(reader, hf_config, tokenizer, dcfg.target_layer_ids)
print(dcfg.hidden_size, dcfg.mask_token_id, "transformers" in sys.modules)
"""


def _setup_in_a_process(*args) -> tuple[int, int, bool]:
    out = subprocess.run([sys.executable, "-c", _SETUP, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    hidden, mask, imported = out.stdout.split()
    return int(hidden), int(mask), imported == "True"


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
    hidden, mask, imported = _setup_in_a_process(cache, weights_only)
    assert hidden == json.loads((tiny_target_dir / "config.json").read_text())["hidden_size"]
    assert not imported, "training's set-up imported transformers"


def test_second_setup_takes_the_tokenizer_facts_from_the_memo(tmp_path, tiny_target_dir, tiny_tokenizer):
    """With a tokenizer: the first start loads it (and checks the cache's tokenizer hash), the
    second reads the remembered facts and checks the same hash without importing transformers."""
    from tests.train_helpers import write_pattern_cache

    cache = write_pattern_cache(tmp_path / "cache.zarr", tiny_target_dir, tiny_tokenizer, n_samples=4)
    memo = tmp_path / "memo"
    first = _setup_in_a_process(cache, tiny_target_dir, memo)
    second = _setup_in_a_process(cache, tiny_target_dir, memo)
    assert first[2] and not second[2]
    assert first[:2] == second[:2]
    other = write_pattern_cache(tmp_path / "other.zarr", tiny_target_dir, tiny_tokenizer, n_samples=4,
                                tokenizer_hash="0" * 64)
    out = subprocess.run([sys.executable, "-c", _SETUP, str(other), str(tiny_target_dir), str(memo)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "tokenizer" in out.stderr  # the remembered hash still refuses a foreign cache


def test_remembered_facts_follow_the_tokenizer_files(tmp_path, tiny_tokenizer_dir):
    """Facts equal those of the loaded tokenizer; a second call does not load; a changed
    tokenizer (a token added) is loaded again and its new facts returned."""
    import shutil

    from transformers import AutoTokenizer

    from dflash.shared.fingerprint import tokenizer_fingerprint
    from dflash.train.tokenizer_facts import MASK_TOKEN, remembered_facts

    folder = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, folder)
    loads = []

    def load():
        loads.append(1)
        return AutoTokenizer.from_pretrained(folder)

    reference = AutoTokenizer.from_pretrained(folder)
    first = remembered_facts(str(folder), tmp_path / "memo", load)
    assert (first.hash, first.mask_id, first.size) == (tokenizer_fingerprint(reference)["hash"],
                                                       reference.get_vocab().get(MASK_TOKEN), len(reference))
    assert remembered_facts(str(folder), tmp_path / "memo", load) == first and len(loads) == 1
    reference.add_tokens(["<|another_token|>"], special_tokens=True)
    reference.save_pretrained(folder)
    changed = remembered_facts(str(folder), tmp_path / "memo", load)
    reloaded = AutoTokenizer.from_pretrained(folder)
    assert len(loads) == 2 and changed.hash != first.hash
    assert (changed.hash, changed.size) == (tokenizer_fingerprint(reloaded)["hash"], len(reloaded))
