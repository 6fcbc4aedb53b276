"""--eval_only: which weights --resume_from_checkpoint names, loaded into the prepared model, and their
accuracy printed and saved as eval.json."""

import json
import os
from pathlib import Path

from accelerate.utils import gather_object
from safetensors.torch import load_file

from shared import stop_together
from shared.intact_checkpoints import first_intact, sha256
from shared.errors import UserError, first_line
from shared.metrics import write_whole
from shared.run_folder import EVAL_FILE, MODEL_FILE, model_saved_after


def weights_to_evaluate(accelerator, spec, output_dir):
    """Every process must call this: what --eval_only evaluates for --resume_from_checkpoint `spec`: a
    checkpoint folder, a model.safetensors, or `latest`, the newer of both in output_dir; and whether it
    is a model file, as the main process found (another machine's disk may lack the file)."""
    if not spec:
        raise UserError("--eval_only needs --resume_from_checkpoint: a checkpoint folder, 'latest' or a model.safetensors file.",
                        every_process=True)
    # os.path.isfile: False for a file in a folder this user cannot enter, which named_checkpoint then says.
    if spec != "latest" and stop_together.on_main_process(accelerator, lambda: os.path.isfile(spec)):
        return Path(spec), True
    checkpoint = first_intact(accelerator, output_dir, spec)
    if spec != "latest":
        return checkpoint, False
    model_file = Path(output_dir) / MODEL_FILE  # on every machine, where each has a disk of its own

    def newest():
        if checkpoint is None and not model_file.exists():
            raise UserError(f"{output_dir} holds neither a checkpoint nor a {MODEL_FILE} to evaluate: pass the --output_dir "
                            "of a run, or a path.")
        # The model file when it is the end of the run that went on from the checkpoint: saved at or after it (a disk
        # that stamps whole seconds gives both one time), as a resume judges it.
        return checkpoint is None or model_saved_after(output_dir, checkpoint)
    return (model_file, True) if stop_together.on_main_process(accelerator, newest) else (checkpoint, False)


def load_model_file(accelerator, model, path):
    """Every process must call this: a model.safetensors into the prepared model, plain, DDP or FSDP2-sharded
    alike. A file that some process cannot read (its machine's disk lacks it) stops every one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # 0.8 s of imports: only here

    weights = sentence = digest = None
    try:
        weights, digest = load_file(path), sha256(path)
    except OSError as error:
        sentence = (f"{path} could not be read by process {accelerator.process_index} ({first_line(error)}): where each machine "
                    "has a disk of its own, copy the file to the same path on each.")
    except Exception as error:  # safetensors' own error for a file that is not one of its
        sentence = _not_this_model(path, error)
    stop_together.if_any_failed(sentence)  # before the load, which is a collective under FSDP
    if len(set(gather_object([digest]))) > 1:  # each machine reads its own copy
        raise UserError(f"The copies of {path} differ from machine to machine: copy the same file to each.", every_process=True)
    try:
        set_model_state_dict(accelerator.unwrap_model(model, keep_torch_compile=False), weights,
                             options=StateDictOptions(full_state_dict=True))
    except Exception as error:  # load_state_dict raises many kinds; the same file fails alike, before any collective
        raise UserError(_not_this_model(path, error), every_process=True) from None


def _not_this_model(path, error):
    return f"{path} does not hold this script's model weights ({first_line(error)}): pass its own model.safetensors."


def report(result, source, accelerator, output_dir):
    """Every process must call this, though the main process alone writes (a failed write stops all of
    them): the accuracy and per-class accuracy of the weights from `source`, printed and saved as eval.json."""
    result = {"weights": str(source), "world_size": accelerator.num_processes, **result}
    accelerator.print(f"{source}: eval_accuracy {result['eval_accuracy']:.4f} over {result['eval_samples']} samples "
                      f"(eval_loss {result['eval_loss']:.4f}, world_size {accelerator.num_processes})")
    for label, accuracy in enumerate(result["eval_per_class_accuracy"]):
        accelerator.print(f"  class {label}: " + ("no sample" if accuracy is None else f"{accuracy:.4f}"))
    with stop_together.if_write_fails(output_dir / EVAL_FILE, "free space or fix the folder, and evaluate again."):
        if accelerator.is_main_process:
            write_whole(output_dir / EVAL_FILE, json.dumps(result, indent=1))
