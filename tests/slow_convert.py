"""``dflash-cache`` with a sleep of ``sys.argv[1]`` seconds after each read that ``convert`` re-encodes, each read
a few batches: a conversion slow enough for a test to stop midway. Run in place of ``-m dflash.shared.cache_cli``."""

import sys
import time

from dflash.shared import convert
from dflash.shared.cache_cli import main

DELAY_S = float(sys.argv.pop(1))
reencode = convert._reencode
convert.SPAN_BYTES = 10_000  # bytes as stored per read


def slow_reencode(*args, **kwargs):
    result = reencode(*args, **kwargs)
    time.sleep(DELAY_S)
    return result


convert._reencode = slow_reencode
main()
