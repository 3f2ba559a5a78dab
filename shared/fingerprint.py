"""Fingerprints of the target and tokenizer: what a cache was made from, which training checks. Hashing full weights
would cost minutes, so a safetensors file's digest covers its size, header and first and last MiB."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "_commit_hash", "name_or_path"}
_EDGE = 1 << 20


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def config_hash(config_dict: dict[str, Any]) -> str:
    clean = {k: v for k, v in config_dict.items() if k not in _VOLATILE_CONFIG_KEYS}
    return _sha(json.dumps(clean, sort_keys=True, default=str))


def _safetensors_file_digest(path: Path) -> str:
    size = path.stat().st_size
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header, head = f.read(header_len), f.read(_EDGE)
        f.seek(max(8 + header_len, size - _EDGE))
        return _sha(str(size).encode() + header + head + f.read(_EDGE))


def weights_hash(model_dir: str | os.PathLike) -> str | None:
    """Digest of the safetensors files of a local checkpoint; None where there are none."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    return _sha("".join(f.name + _safetensors_file_digest(f) for f in files)) if files else None


def target_fingerprint(name_or_path: str, config_dict: dict[str, Any], dtype: str,
                       revision: str | None = None) -> dict[str, Any]:
    """Name, revision, config hash, weights hash (of a local folder) and compute dtype of a target."""
    return {"name_or_path": str(name_or_path), "revision": revision or config_dict.get("_commit_hash"),
            "config_hash": config_hash(config_dict),
            "weights_hash": weights_hash(name_or_path) if os.path.isdir(name_or_path) else None, "dtype": dtype}


def tokenizer_fingerprint(tokenizer) -> dict[str, Any]:
    """Hash of the tokenizer's vocabulary and rules, and of its chat template, apart."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # slow tokenizers: the vocabulary is what defines them
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    special = json.dumps({k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}, sort_keys=True)
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else json.dumps(template, sort_keys=True, default=str)
    return {"hash": _sha(body + special), "chat_template_hash": _sha(template or ""), "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}


def fingerprint_digest(fingerprint: dict[str, Any]) -> str:
    """sha256 of a fingerprint's canonical JSON: names one cache's content in a line."""
    return "sha256:" + _sha(json.dumps(fingerprint, sort_keys=True, default=str, separators=(",", ":")))
