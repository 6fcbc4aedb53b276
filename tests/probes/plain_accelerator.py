"""Launched by the tests like any Accelerate script that is not ours: it builds a plain Accelerator(),
as accelerate's own examples do, and records the group it finds itself in."""

import json
import os
import sys
from pathlib import Path

from accelerate import Accelerator


def main():
    accelerator = Accelerator()
    report = {"rank": accelerator.process_index, "num_processes": accelerator.num_processes,
              "distributed_type": accelerator.distributed_type.value}
    accelerator.wait_for_everyone()
    (Path(sys.argv[1]) / f"{report['rank']}_{os.getpid()}.json").write_text(json.dumps(report))
    accelerator.end_training()


if __name__ == "__main__":
    main()
