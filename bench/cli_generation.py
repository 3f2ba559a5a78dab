"""What generating every command's flags from its dataclasses costs at start-up (CPU).

Times `shared.cli_options.options` over the settings dataclasses of all five CLIs with
every cache cleared (field docs read from the source, annotations resolved, click
parameters built), best of `--repeats`, and prints the flag count and milliseconds.

    python bench/cli_generation.py
"""

from __future__ import annotations

import argparse
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()

    from dflash.eval.cli import EvalConfig
    from dflash.extract.config import ExtractConfig
    from dflash.extract.regenerate_cli import RegenerateOptions
    from dflash.shared import cache_cli
    from dflash.shared import cli_options as co
    from dflash.train.config import ExportOptions, RunOptions, TrainConfig

    classes = [ExtractConfig, RegenerateOptions, TrainConfig, RunOptions, ExportOptions, EvalConfig,
               cache_cli.InfoOptions, cache_cli.ShowOptions, cache_cli.VerifyOptions, cache_cli.StatsOptions]
    best = float("inf")
    for _ in range(args.repeats):
        for cached in (co.field_docs, co.field_flags, co._module_tree):
            cached.cache_clear()
        start = time.perf_counter()
        for cls in classes:
            co.options(cls)(lambda **values: None)
        best = min(best, time.perf_counter() - start)
    flags = sum(len(co.field_flags(cls)) for cls in classes)
    print(f"{flags} flags from {len(classes)} dataclasses: {1e3 * best:.1f} ms (best of {args.repeats})")


if __name__ == "__main__":
    main()
