"""Launched by the tests like a training script: records this process's group and the training
indices it draws, using the scripts' own Accelerator settings and DataLoader recipe."""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader

from shared import data, runtime


def main():
    output_dir, num_samples, batch_size, pipeline = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    accelerator = Accelerator(
        cpu=runtime.cpu_only(), dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0)
    )
    samples = torch.arange(num_samples)
    if pipeline == "memory":  # the labels are the sample indices
        loader = accelerator.prepare(data.InMemoryLoader(samples, samples, batch_size, accelerator, seed=0))
    else:
        loader = accelerator.prepare(DataLoader(samples, batch_size=batch_size, shuffle=True))
    epochs = {}
    for epoch in (1, 2):
        loader.set_epoch(epoch)
        epochs[epoch] = [(batch[1] if pipeline == "memory" else batch).tolist() for batch in loader]
    report = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "group_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "epochs": epochs,
    }
    # Every rank also learns what the others drew, to check that they agree on one order.
    report["all_first_batches"] = accelerator.gather(torch.tensor(epochs[1][0])).tolist()
    (output_dir / f"rank{accelerator.process_index}.json").write_text(json.dumps(report))
    accelerator.end_training()  # leaves the process group cleanly before the interpreter exits


if __name__ == "__main__":
    main()
