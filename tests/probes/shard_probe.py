"""Launched by the tests like a training script: records this process's group and the training
indices it draws through each data pipeline, the in-memory loader and the scripts' own Accelerator
settings and DataLoader recipe, in one launch."""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

from shared.devices import cpu_only
from shared.in_memory_loader import InMemoryLoader


def draws(loader, labels_of):
    """The indices drawn in epochs 1 and 2, batch by batch."""
    epochs = {}
    for epoch in (1, 2):
        loader.set_epoch(epoch)
        epochs[epoch] = [labels_of(batch).tolist() for batch in loader]
    return epochs


def main():
    output_dir, num_samples, batch_size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    accelerator = Accelerator(
        cpu=cpu_only(), dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0)
    )
    samples = torch.arange(num_samples)
    epochs = {  # the in-memory loader's labels are the sample indices
        "memory": draws(accelerator.prepare(InMemoryLoader(TensorDataset(samples, samples), batch_size, accelerator, seed=0)), lambda batch: batch[1]),
        "torchvision": draws(accelerator.prepare(DataLoader(samples, batch_size=batch_size, shuffle=True)), lambda batch: batch),
    }
    report = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "group_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "epochs": epochs,
        # Every rank also learns what the others drew, to check that they agree on one order.
        "all_first_batches": {pipeline: accelerator.gather(torch.tensor(drawn[1][0])).tolist() for pipeline, drawn in epochs.items()},
    }
    (output_dir / f"rank{accelerator.process_index}.json").write_text(json.dumps(report))
    accelerator.end_training()  # leaves the process group cleanly before the interpreter exits


if __name__ == "__main__":
    main()
