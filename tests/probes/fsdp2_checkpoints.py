"""Launched by the tests on CPU processes: accelerate's own FSDP2 checkpoint functions (what
accelerator.save_state and load_state call under fsdp.yaml: save_fsdp_model, save_fsdp_optimizer and
their load_ twins, torch's distributed checkpoint underneath) on mnist_conv's Net, sharded with
fully_shard over gloo, which accelerate itself only does on GPUs.

    probe save FOLDER        train 2 steps on each process's own batch, take the main process's BatchNorm statistics as
                             the scripts do before a save, save the sharded checkpoint, and the full state for reference
    probe load FOLDER        load it (at another process count), record whether the full state is the saved one
    probe damaged FOLDER     load it inside the scripts' checkpoints.loading, after the test has damaged a shard
    probe own_disks FOLDER   save with each process writing into a folder of its own, as machines without a
                             shared disk would, then try to load each process's own folder
    probe refuse FOLDER      the scripts' run_folder.prepare, with the Accelerator as fsdp.yaml makes it
"""

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, broadcast
from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

from shared import checkpoints, run_folder
from shared.errors import run_main

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the script's model class
import mnist_conv  # noqa: E402

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0


class UnderFsdp:
    """The Accelerator, saying what it says under fsdp.yaml (accelerate gives the CPU no FSDP of its own)."""

    distributed_type = DistributedType.FSDP

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def __getattr__(self, name):
        return getattr(self.accelerator, name)


def main():
    mode, folder = sys.argv[1], Path(sys.argv[2])
    accelerator = Accelerator(cpu=True)
    if mode == "refuse":
        run_folder.prepare(UnderFsdp(accelerator), folder, overwrite=False, resuming=False)
        return
    rank = accelerator.process_index
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    under_fsdp = SimpleNamespace(process_index=rank, num_processes=accelerator.num_processes, is_fsdp2=True,
                                 is_main_process=accelerator.is_main_process, wait_for_everyone=accelerator.wait_for_everyone)
    loads = mode in ("load", "damaged")
    torch.manual_seed(100 + rank if loads else 0)  # a load starts from other weights than those saved
    model = mnist_conv.Net()
    for layer in (model.conv2, model.fc1):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    # Each process's own batches, as in training: BatchNorm's running statistics differ from process to process.
    images, labels = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(1 + rank)), torch.arange(8)
    for _ in range(0 if loads else 2):
        optimizer.zero_grad()
        F.nll_loss(model(images), labels).backward()
        optimizer.step()
    if not loads:  # the scripts' lines before a save: torch's sharded save writes any process's copy of a buffer
        for buffer in model.buffers():
            broadcast(buffer)
    record = {"world_size": accelerator.num_processes}
    if mode == "damaged":  # torch's sharded load raises its CheckpointException, a BaseException, on every process together
        with checkpoints.loading(folder, UnderFsdp(accelerator)):
            load_fsdp_model(plugin, under_fsdp, model, folder)
    elif mode == "load":
        load_fsdp_model(plugin, under_fsdp, model, folder)
        load_fsdp_optimizer(plugin, under_fsdp, optimizer, model, folder)
        saved = torch.load(folder / "full_state.pt", weights_only=False)
        now = (get_model_state_dict(model, options=FULL), get_optimizer_state_dict(model, optimizer, options=FULL))
        if accelerator.is_main_process:
            record["model_as_saved"] = all(torch.equal(now[0][name], saved[0][name]) for name in saved[0])
            record["optimizer_as_saved"] = all(torch.equal(now[1]["state"][name][key], value)
                                               for name, state in saved[1]["state"].items() for key, value in state.items())
    else:
        target = folder / f"rank_{rank}" if mode == "own_disks" else folder
        full = copy.deepcopy((get_model_state_dict(model, options=FULL), get_optimizer_state_dict(model, optimizer, options=FULL)))
        save_fsdp_model(plugin, under_fsdp, model, target)
        save_fsdp_optimizer(plugin, under_fsdp, optimizer, model, target)
        if accelerator.is_main_process:
            torch.save(full, folder / "full_state.pt")
        record["files"] = sorted(path.relative_to(target).as_posix() for path in target.rglob("*/*"))
        if mode == "own_disks":
            try:
                load_fsdp_model(plugin, under_fsdp, model, target)
                record["own_folder_loads"] = "loads"
            except BaseException as error:  # noqa: BLE001  torch's CheckpointException is a BaseException
                record["own_folder_loads"] = " ".join(str(error).split())[-300:]
    (folder / f"{mode}_{accelerator.num_processes}_rank_{rank}.json").write_text(json.dumps(record))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    run_main(main)
