"""The four scripts' main() functions stay copies of one training story, as accelerate's
tests/test_examples.py keeps its examples: each script's main() is compared line by line with
mnist_conv.py's, and may differ only in the lines listed here (its model, its data, its extras).
A change to one script's loop that its siblings do not get fails here."""

import ast
import difflib

import pytest

from conftest import SCRIPTS

REFERENCE = "mnist_conv.py"
# Lines (comments aside) that may differ from the reference's, by how they start.
EVERY_SCRIPT = ("model = ", "if args.channels_last:", "model = model.to(memory_format=", 'accelerator.init_trackers("',
                "runtime.keep_batchnorm_in_float32_under_fsdp(")  # only the BatchNorm net needs it
OWN_LINES = {
    "seq_net.py": ("normalize=NORMALIZE,",),  # its pixels stay in [0, 1]
    "cpu_gloo.py": (
        "cpu=True,", "cpu=runtime.cpu_only(),",  # the tutorial is about CPU processes, even on a machine with GPUs
        "for images, labels in tqdm(", "progress_bar = tqdm(", "for batch_index, (images, labels) in enumerate(progress_bar",
        "if batch_index % args.log_interval == 0:", "losses = accelerator.gather(", "if accelerator.is_main_process:",
        "progress_bar.write(",
    ),
    "toy_mlp.py": (
        "train_loader, test_loader = data.mnist_loaders(",  # built-in rows instead of MNIST
        "accelerator, DATA_SET, batch_size, args.eval_batch_size,", "hub_name=args.dataset_name,", ")",  # (its last line)
        "train_set, test_set = ", "train_loader = DataLoader(", "train_eval_loader = DataLoader(", "test_loader = DataLoader(",
        "model, optimizer, train_loader, ", "results = metrics.evaluate(model, test_loader, accelerator, loss_function, num_classes=",
        "for images, labels in tqdm(", "for features, labels in batches:",
        "loss = loss_function(model(",  # features, not images
        "train_eval = metrics.evaluate(", "record = metrics_log.write(epoch, ", 'accelerator.print(f"Training accuracy',
    ),
}


def main_lines(source):
    """main()'s lines of code, stripped of indentation and comments."""
    function = next(node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == "main")
    lines = source.splitlines()[function.lineno - 1:function.end_lineno]
    code = (line.split("  # ")[0].strip() for line in lines)
    return [line for line in code if line and not line.startswith("#")]


def drifted_lines(script, source):
    """The lines where `source` (the script's) differs from the reference's main() beyond what it may."""
    allowed = EVERY_SCRIPT + OWN_LINES[script]
    reference = main_lines((SCRIPTS / REFERENCE).read_text())
    return [line for line in difflib.ndiff(reference, main_lines(source))
            if line[:2] in ("- ", "+ ") and not line[2:].startswith(allowed)]


@pytest.mark.parametrize("script", sorted(OWN_LINES))
def test_every_script_tells_the_same_training_story(script):
    assert drifted_lines(script, (SCRIPTS / script).read_text()) == []


def test_a_change_to_one_script_alone_is_caught():
    source = (SCRIPTS / "cpu_gloo.py").read_text()
    changed = source.replace("accelerator.backward(loss)", "loss.backward()")
    assert changed != source
    assert drifted_lines("cpu_gloo.py", changed) == ["- accelerator.backward(loss)", "+ loss.backward()"]
