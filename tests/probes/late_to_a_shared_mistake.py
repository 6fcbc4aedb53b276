"""Launched by the tests like a training script: every rank finds the same mistake before any process
group forms (as a bad flag or a GPU profile on a machine without GPUs do), rank 0 a second after the
others, as a loaded machine can make it."""

import os
import time

from shared.errors import UserError, run_main


def main():
    if os.environ.get("RANK") == "0":
        time.sleep(1)
    raise UserError("a mistake every rank found: fix it.", every_process=True)


if __name__ == "__main__":
    run_main(main)
