"""Launched by the tests on 2 CPU processes: accelerate's own FSDP2 wrapping (fsdp2_prepare_model, with
the policy fsdp.yaml gives: bf16) applied to mnist_conv's Net over gloo, which accelerate itself only
does on GPUs. Records, per rank, what the GPU paths of the scripts meet (JSON in argv[1]):
- the defect: BatchNorm's bf16 weights against its fp32 running statistics;
- the fix: mnist_conv.keep_batchnorm_in_float32_under_fsdp's shards;
- the fp32 loss of the scripts' loss line, and the dtype the model hands back;
- --eval_only's load of a full model.safetensors into DTensor parameters, plainly and through torch's
  distributed state-dict API;
- BatchNorm's running statistics per rank, before and after the scripts' evaluate(), which takes the
  main process's."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the script's model class
import mnist_conv  # noqa: E402


def wrap(model, accelerator):
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=100000)
    plugin.set_mixed_precision("bf16")  # what accelerate sets for fsdp.yaml's mixed_precision: bf16
    stand_in = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None, parallelism_config=None,
                               mixed_precision="bf16", is_main_process=accelerator.is_main_process, device=torch.device("cpu"))
    return fsdp2_prepare_model(stand_in, model)


def main():
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    torch.manual_seed(0)
    images, labels = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    record = {"world_size": accelerator.num_processes}

    torch.manual_seed(1)
    plain = mnist_conv.Net()
    full_weights = {name: tensor.clone() for name, tensor in plain.state_dict().items()}
    try:
        wrap(mnist_conv.Net(), accelerator)(images)
        record["as_accelerate_wraps_it"] = "trains"
    except RuntimeError as error:
        record["as_accelerate_wraps_it"] = str(error).splitlines()[0]

    model = mnist_conv.Net()
    mnist_conv.keep_batchnorm_in_float32_under_fsdp(SimpleNamespace(is_fsdp2=True, mixed_precision="bf16"), model)
    model = wrap(model, accelerator)
    computed_in = {}  # the dtype of each layer's weight while it computes (FSDP unshards and casts it then)
    for name in ("conv1", "n1"):
        getattr(model, name).register_forward_pre_hook(lambda module, inputs, name=name: computed_in.update({name: str(module.weight.dtype)}))
    output = model(images + rank)  # each rank its own batch, as data parallelism gives
    loss = F.nll_loss(output.float(), labels)  # the scripts' loss line
    loss.backward()
    record.update(output_dtype=str(output.dtype), loss_dtype=str(loss.dtype),
                  batchnorm_weight_dtype=computed_in["n1"], conv_weight_dtype=computed_in["conv1"])
    record["running_mean_differs"] = _differs_across_ranks(model.n1.running_mean)
    mnist_conv.evaluate(model, [(images, labels)], accelerator)
    record["running_mean_differs_after"] = _differs_across_ranks(model.n1.running_mean)

    try:
        model.load_state_dict(full_weights)
        record["plain_load_state_dict"] = "loads"
    except Exception as error:  # noqa: BLE001  what --eval_only used to meet
        record["plain_load_state_dict"] = " ".join(str(error).split())[:400]
    set_model_state_dict(model, dict(full_weights), options=StateDictOptions(full_state_dict=True))  # it puts DTensors in the dict
    loaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if accelerator.is_main_process:
        record["full_state_dict_round_trip"] = all(torch.equal(loaded[name], full_weights[name]) for name in full_weights)
    Path(sys.argv[1], f"rank_{rank}.json").write_text(json.dumps(record))


def _differs_across_ranks(tensor):
    gathered = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, tensor.contiguous())
    return any(not torch.equal(gathered[0], other) for other in gathered[1:])


if __name__ == "__main__":
    main()
