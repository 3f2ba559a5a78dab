"""``dflash-extract`` with a sleep of ``sys.argv[1]`` seconds before each batch's forward: a run slow
enough for a test to stop midway. Started by torchrun in place of ``-m dflash.extract.cli``."""

import sys
import time

from dflash.extract.cli import main
from dflash.extract.target import TargetRunner

DELAY_S = float(sys.argv.pop(1))
forward = TargetRunner.forward


def slow_forward(self, *args):
    time.sleep(DELAY_S)
    return forward(self, *args)


TargetRunner.forward = slow_forward
main()
