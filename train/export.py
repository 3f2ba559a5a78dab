"""Export a drafter as the folder SGLang and vLLM read (config.json of a DFlashDraftModel +
model.safetensors under the state-dict names), check it against its target, serve and load it."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.shared.layers import check_layer_ids

from .model import DFlashDrafter, DrafterConfig
from .target import MASK_TOKEN, tokenizer_mask_id

ARCHITECTURE = "DFlashDraftModel"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
LAYER_ID_CONVENTION = "id i = output of target decoder layer i = HF hidden_states[i + 1]"

_REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "vocab_size", "num_target_layers", "num_hidden_layers", "block_size", "rms_norm_eps",
             "max_position_embeddings")


def export_config_dict(config: DrafterConfig, dtype: torch.dtype) -> dict:
    """The config.json content for ``config`` with weights stored in ``dtype``."""
    dtype_name = str(dtype).removeprefix("torch.")
    shapes = {k: v for k, v in config.to_dict().items() if k not in ("target_layer_ids", "mask_token_id")}
    return {"architectures": [ARCHITECTURE], "model_type": "qwen3",
            "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids),
                              "target_layer_id_convention": LAYER_ID_CONVENTION},
            "eagle_aux_hidden_state_layer_ids": eagle_layer_ids(config.target_layer_ids),
            **shapes,  # block_size, num_target_layers and the Qwen3 fields: the drafter config's own names
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
            "hidden_act": "silu", "attention_dropout": 0.0, "tie_word_embeddings": False,
            "torch_dtype": dtype_name, "dtype": dtype_name}


def eagle_layer_ids(target_layer_ids: list[int]) -> list[int]:
    """The same layers in the numbering of older vLLM's ``eagle_aux_hidden_state_layer_ids``."""
    return [int(i) + 1 for i in target_layer_ids]


def check_against_target(config: DrafterConfig, target, tokenizer=None) -> None:
    """Raise ValueError naming every way the drafter does not fit ``target`` (an HF config or a loaded
    model): sizes, layers, and the MASK row (the tokenizer's <|MASK|> where it has one, as SGLang asks)."""
    loaded = hasattr(target, "get_input_embeddings")
    text = (target.config if loaded else target).get_text_config()
    vocab = target.get_input_embeddings().weight.shape[0] if loaded else text.vocab_size
    problems = [f"{name}: the drafter has {ours}, the target {theirs}"
                for name, ours, theirs in (("hidden size", config.hidden_size, text.hidden_size),
                                           ("vocabulary size", config.vocab_size, vocab),
                                           ("num_target_layers", config.num_target_layers, text.num_hidden_layers))
                if ours != theirs]
    try:
        check_layer_ids(config.target_layer_ids, text.num_hidden_layers)
    except ValueError as e:
        problems.append(str(e))
    if not 0 <= config.mask_token_id < vocab:
        problems.append(f"mask_token_id {config.mask_token_id} is outside the target vocabulary [0, {vocab})")
    if (tokenizer_mask := tokenizer_mask_id(tokenizer)) is not None and tokenizer_mask != config.mask_token_id:
        problems.append(f"mask_token_id {config.mask_token_id} is not the tokenizer's {MASK_TOKEN} ({tokenizer_mask})")
    if problems:
        raise ValueError("the drafter does not fit the target:\n  - " + "\n  - ".join(problems))


def serve_commands(export_dir: str | os.PathLike, target: str, block_size: int) -> dict[str, str]:
    """Shell command lines that serve ``target`` with the exported drafter in SGLang and vLLM."""
    draft = str(Path(export_dir).resolve())
    vllm_spec = json.dumps({"method": "dflash", "model": draft, "num_speculative_tokens": block_size - 1})
    return {"sglang": (f"python -m sglang.launch_server --model-path {shlex.quote(target)} "
                       f"--speculative-algorithm DFLASH --speculative-draft-model-path {shlex.quote(draft)} "
                       f"--speculative-num-draft-tokens {block_size}"),
            "vllm": f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(vllm_spec)}"}


def config_from_export_dict(data: dict) -> DrafterConfig:
    """DrafterConfig from an exported config.json, with clear errors on missing fields."""
    if ARCHITECTURE not in (data.get("architectures") or []):
        raise ValueError(f"config.json architectures={data.get('architectures')!r}; expected [{ARCHITECTURE!r}]")
    if not isinstance(dflash := data.get("dflash_config"), dict):
        raise ValueError("config.json lacks the dflash_config section")
    eagle = data.get("eagle_aux_hidden_state_layer_ids")
    if eagle is not None and list(eagle) != eagle_layer_ids(dflash.get("target_layer_ids") or []):
        raise ValueError(f"config.json: eagle_aux_hidden_state_layer_ids {eagle} is not dflash_config.target_layer_ids "
                         f"{dflash.get('target_layer_ids')} + 1; a serving engine would read other layers")
    missing = [k for k in _REQUIRED if k not in data] + [k for k in ("target_layer_ids", "mask_token_id")
                                                        if k not in dflash]
    if missing or (theta := data.get("rope_theta", (data.get("rope_parameters") or {}).get("rope_theta"))) is None:
        raise ValueError(f"config.json lacks {missing or ['rope_theta']}")
    values = {f.name: data[f.name] for f in fields(DrafterConfig) if f.name in data}  # export_config_dict's names
    return DrafterConfig(**{**values, "rope_theta": float(theta), "target_layer_ids": dflash["target_layer_ids"],
                            "mask_token_id": int(dflash["mask_token_id"])})


def export_drafter(drafter: DFlashDrafter, config: DrafterConfig, out_dir: str | os.PathLike,
                   dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors of the plain drafter (cast to ``dtype``) to ``out_dir``: a new folder
    or an earlier export, never another model's folder or a run's; each file whole or not at all."""
    state = drafter.state_dict()
    _check_names_and_shapes(state, config, "drafter state_dict")
    dtype = dtype or next(iter(state.values())).dtype
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in state.items()}
    out = Path(out_dir)
    if (out / CONFIG_NAME).exists():
        try:
            ours = json.loads((out / CONFIG_NAME).read_text()).get("architectures") == [ARCHITECTURE]
        except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not a JSON object
            ours = False
        if not ours:
            raise ValueError(f"{out} holds a {CONFIG_NAME} that is not a DFlash drafter's (a target's, or a training "
                             "run's?); export into a new folder or over an earlier export")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / f".{WEIGHTS_NAME}.partial"), metadata={"format": "pt"})
    (out / f".{CONFIG_NAME}.partial").write_text(json.dumps(export_config_dict(config, dtype), indent=2) + "\n")
    for name in (WEIGHTS_NAME, CONFIG_NAME):  # each written whole, then renamed into place
        os.replace(out / f".{name}.partial", out / name)
    return out


def load_exported(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
                  ) -> tuple[DFlashDrafter, DrafterConfig]:
    """Load an exported folder, checking every tensor name and shape against the config."""
    config = config_from_export_dict(json.loads((Path(path) / CONFIG_NAME).read_text()))
    tensors = load_file(str(Path(path) / WEIGHTS_NAME))
    _check_names_and_shapes(tensors, config, str(Path(path) / WEIGHTS_NAME))
    dtype = dtype or next(iter(tensors.values())).dtype  # as stored
    with torch.device("meta"):
        drafter = DFlashDrafter(config).to_empty(device=device).to(dtype)
    drafter.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    return drafter, config


def _check_names_and_shapes(tensors: dict, config: DrafterConfig, where: str) -> None:
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in DFlashDrafter(config).state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    wrong = sorted(f"{n}: {tuple(tensors[n].shape)} != {expected[n]}" for n in set(expected) & set(tensors)
                   if tuple(tensors[n].shape) != expected[n])
    problems = [f"{what} {names}" for what, names in (("missing", missing), ("unexpected", unexpected),
                                                      ("wrong shapes", wrong)) if names]
    if problems:
        raise ValueError(f"{where} does not match the DFlash export format: " + "; ".join(problems))
