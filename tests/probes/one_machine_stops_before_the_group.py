"""Launched by the tests on two machines: the process of the machine given as the argument finds a
mistake before the process group forms (as a GPU profile on a machine without GPUs, or a bad flag under
plain accelerate launch, do), while the other's builds its Accelerator and waits for it to join, as
long as --ddp_timeout (here 5 s), or until machine 0's launcher, which holds the rendezvous, has gone."""

import os
import sys
from datetime import timedelta

from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from shared.devices import cpu_only
from shared.errors import UserError, run_main


def main():
    if os.environ["GROUP_RANK"] == sys.argv[1]:  # torchrun's machine rank
        raise UserError(f"a mistake machine {sys.argv[1]} found before the process group formed: fix it.", every_process=True)
    Accelerator(cpu=cpu_only(), kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=5))])


if __name__ == "__main__":
    run_main(main)
