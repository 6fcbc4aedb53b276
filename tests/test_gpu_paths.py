"""The GPU paths' defects, shown on the CPU: accelerate's FSDP2 wrapping over gloo (which accelerate
itself only does on GPUs), and the in-memory loader's batches reaching a device the data set is not on.
What only a GPU can show is in test_gpu.py (`python -m pytest -m gpu`)."""

import json
import sys
from types import SimpleNamespace

import torch
from torch.utils.data import TensorDataset

from conftest import CONFIGS, SCRIPTS, run

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


def test_the_in_memory_loader_moves_each_batch_to_the_accelerators_device():
    """A data set too large for the GPU's free memory stays on the CPU (InMemoryLoader's home); each batch
    must still reach the device the model is on. The meta device stands in for the GPU here."""
    accelerator = SimpleNamespace(process_index=0, num_processes=1, device=torch.device("meta"))
    loader = InMemoryLoader(TensorDataset(torch.randn(10, 1, 28, 28), torch.arange(10)), 4, accelerator, seed=0, home=torch.device("cpu"))
    batches = list(loader)
    assert [len(labels) for _, labels in batches] == [4, 4, 2]
    assert {tensor.device.type for batch in batches for tensor in batch} == {"meta"}
