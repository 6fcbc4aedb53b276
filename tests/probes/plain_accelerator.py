"""Launched by the tests like any Accelerate script that is not ours: it builds a plain Accelerator(),
as accelerate's own examples do, and records the group it finds itself in."""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from accelerate import Accelerator


def main():
    accelerator = Accelerator()
    report = {"rank": accelerator.process_index, "num_processes": accelerator.num_processes,
              "distributed_type": accelerator.distributed_type.value,
              "torch_world_size": dist.get_world_size() if dist.is_initialized() else None}
    # Under plain `accelerate launch` without a GPU, accelerate still joins torchrun's processes in one
    # gloo group but reports world size 1, so wait_for_everyone() is a no-op. A process that left right
    # after its own init would close the connections a slower one is still making (gloo's
    # connectFullMesh fails with "Connection closed by peer"), so wait on torch's group itself.
    if dist.is_initialized():
        dist.barrier()
    (Path(sys.argv[1]) / f"{report['rank']}_{os.getpid()}.json").write_text(json.dumps(report))
    accelerator.end_training()


if __name__ == "__main__":
    main()
