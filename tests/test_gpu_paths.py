"""The GPU paths' defects, shown on the CPU: accelerate's FSDP2 wrapping over gloo (which accelerate
itself only does on GPUs), and the in-memory loader's batches reaching a device the data set is not on.
What only a GPU can show is in test_gpu.py (`python -m pytest -m gpu`)."""

import json
import sys
from types import SimpleNamespace

import torch
from torch.utils.data import TensorDataset

from conftest import CONFIGS, SCRIPTS, forks_made, run, scripts_of, two_machines

from shared.in_memory_loader import InMemoryLoader

PROBES = SCRIPTS.parent / "tests" / "probes"


def test_fsdp2_with_bf16_batchnorm_loss_eval_only_and_buffers_on_two_cpu_processes(tmp_path):
    run([sys.executable, SCRIPTS / "launch.py", "--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2",
         PROBES / "fsdp2_on_cpu.py", tmp_path], cwd=tmp_path)
    ranks = [json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in (0, 1)]
    for record in ranks:
        assert record["world_size"] == 2
        # accelerate's FSDP2 policy casts BatchNorm's weights to bf16 and leaves its statistics fp32
        assert record["as_accelerate_wraps_it"] == "expected scalar type BFloat16 but found Float"
        # a shard of its own keeps BatchNorm fp32; the rest computes in bf16 and hands bf16 back
        assert (record["batchnorm_weight_dtype"], record["conv_weight_dtype"]) == ("torch.float32", "torch.bfloat16")
        assert (record["output_dtype"], record["loss_dtype"]) == ("torch.bfloat16", "torch.float32")
        # each rank's statistics follow its own batches, until taken from the main process
        assert record["running_mean_differs"] and not record["running_mean_differs_after"]
        # --eval_only's old plain load_state_dict fails on sharded parameters; torch's state-dict API loads them
        assert "DTensor" in record["plain_load_state_dict"]
    assert ranks[0]["full_state_dict_round_trip"]


def launch_probe(mode, folder, num_processes):
    run([sys.executable, SCRIPTS / "launch.py", "--config_file", CONFIGS / "cpu.yaml", "--num_processes", num_processes,
         PROBES / "fsdp2_checkpoints.py", mode, folder], cwd=folder)
    return [json.loads((folder / f"{mode}_{num_processes}_rank_{rank}.json").read_text()) for rank in range(num_processes)]


def test_fsdp2_sharded_checkpoints_resume_at_another_process_count(tmp_path):
    """fsdp.yaml's checkpoints, through accelerate's own FSDP2 save and load: saved by 2 processes, loaded
    by 3 (uneven shards) and by 1, the model and the optimizer state are the ones saved, bitwise. The processes
    trained on batches of their own, and took the main process's BatchNorm statistics before the save, as the
    scripts do: without that, the checkpoint held another process's (torch's save writes any copy of a buffer)."""
    saved = launch_probe("save", tmp_path, 2)
    assert [record["world_size"] for record in saved] == [2, 2]
    assert {"pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__1_0.distcp", "optimizer_0/__1_0.distcp"} <= set(saved[0]["files"])
    for num_processes in (3, 1):
        loaded = launch_probe("load", tmp_path, num_processes)
        assert [record["world_size"] for record in loaded] == [num_processes] * num_processes
        assert loaded[0]["model_as_saved"] and loaded[0]["optimizer_as_saved"]
    # A shard cut short (its digest checked by the scripts before, this one damaged after): the load fails on every
    # process, said once; before, torch's CheckpointException, a BaseException, passed the scripts' handler: a traceback each.
    shard = tmp_path / "pytorch_model_fsdp_0" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:64])
    with forks_made() as new_forks:
        failed = run([sys.executable, SCRIPTS / "launch.py", "--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2",
                      PROBES / "fsdp2_checkpoints.py", "damaged", tmp_path], cwd=tmp_path, check=False)
    assert scripts_of(new_forks).count("fsdp2_checkpoints.py") == 2, "2 processes started"
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    (line,) = failed.stderr.splitlines()
    assert line.startswith(f"error: Checkpoint {tmp_path} could not be loaded (") and line.endswith("): resume from an earlier one."), line


def test_fsdp2_on_machines_without_a_shared_output_dir_is_refused_at_start(tmp_path):
    """The defect, reproduced: each process saving into a folder of its own (as machines with a disk each
    would), the index of the shards (.metadata) is only in the main process's folder, each folder holds
    its own shards alone, and no process can load its own. So the scripts refuse such a launch before
    anything is written: two machines, each with its own --output_dir, both say why in one sentence."""
    records = launch_probe("own_disks", tmp_path, 2)
    assert records[0]["files"] == ["optimizer_0/.metadata", "optimizer_0/__0_0.distcp", "pytorch_model_fsdp_0/.metadata",
                                   "pytorch_model_fsdp_0/__0_0.distcp"]
    assert records[1]["files"] == ["optimizer_0/__1_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp"]
    assert all("No such file or directory" in record["own_folder_loads"] for record in records)

    folders = [tmp_path / "machine_0", tmp_path / "machine_1"]
    results = two_machines(tmp_path, [[PROBES / "fsdp2_checkpoints.py", "refuse", folder] for folder in folders])
    for result in results:
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert [line for line in result.stderr.splitlines() if "error:" in line] == [
            f"error: --output_dir {folders[0]} is not on a disk that every machine shares, which FSDP's sharded checkpoints need "
            "(each machine would hold only its own shards): put --output_dir on a shared file system."]
    assert not any(folder.exists() for folder in folders), "nothing is left behind"


def test_the_in_memory_loader_moves_each_batch_to_the_accelerators_device():
    """A data set too large for the GPU's free memory stays on the CPU (InMemoryLoader's home); each batch
    must still reach the device the model is on. The meta device stands in for the GPU here."""
    accelerator = SimpleNamespace(process_index=0, num_processes=1, device=torch.device("meta"))
    loader = InMemoryLoader(TensorDataset(torch.randn(10, 1, 28, 28), torch.arange(10)), 4, accelerator, seed=0, home=torch.device("cpu"))
    batches = list(loader)
    assert [len(labels) for _, labels in batches] == [4, 4, 2]
    assert {tensor.device.type for batch in batches for tensor in batch} == {"meta"}
