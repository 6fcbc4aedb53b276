"""The three complete scripts' main() and evaluate() stay copies of one training story, as accelerate's
tests/test_examples.py keeps its examples: each is compared line by line with mnist_conv.py's, and
may differ only in the lines listed here (its model, its optimizer, its extras). A change to one
script's loop that its siblings do not get fails here. (toy_mlp.py, the first rung, is a story of its own.)"""

import ast
import difflib

import pytest

from conftest import SCRIPTS

REFERENCE = "mnist_conv.py"
# Lines (comments aside) that may differ from the reference's, by how they start.
EVERY_SCRIPT = ("model = ", 'accelerator.init_trackers("')
OWN_LINES = {
    "seq_net.py": ("pipeline=args.data_pipeline, normalize=NORMALIZE)", "pipeline=args.data_pipeline)", "optimizer = torch.optim.Adam("),
    "cpu_gloo.py": (
        "cpu=True,", "cpu=devices.cpu_only(),",  # the tutorial is about CPU processes, even on a machine with GPUs
        "optimizer = torch.optim.SGD(",
        "for images, labels in tqdm(", "progress_bar = tqdm(", "for batch_index, (images, labels) in enumerate(progress_bar",
        "if batch_index % args.log_interval == 0:", "losses = accelerator.gather(", "if accelerator.is_main_process:",
        "progress_bar.write(", '+ "  ".join(',
    ),
}
# The reference's own lines that its siblings leave out: the conv net's channels_last and BatchNorm fix.
REFERENCE_ONLY = ("if args.channels_last:", "model = model.to(memory_format=", "keep_batchnorm_in_float32_under_fsdp(",
                  "optimizer = torch.optim.Adadelta(")


def main_lines(source):
    """The lines of code of evaluate() and main(), comments aside, with their indentation: a line moved into or
    out of a block (zero_grad out of `with accelerator.accumulate`, a save under `if accelerator.is_main_process:`)
    differs."""
    lines = []
    for function in (node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name in ("evaluate", "main")):
        code = (line.split("  # ")[0].rstrip() for line in source.splitlines()[function.lineno - 1:function.end_lineno])
        lines += [line for line in code if line.strip() and not line.strip().startswith("#")]
    return lines


def drifted_lines(script, source):
    """The lines where `source` (the script's) differs from the reference's main() beyond what it may."""
    allowed = EVERY_SCRIPT + OWN_LINES[script] + REFERENCE_ONLY
    reference = main_lines((SCRIPTS / REFERENCE).read_text())
    return [line for line in difflib.ndiff(reference, main_lines(source))
            if line[:2] in ("- ", "+ ") and not line[2:].lstrip().startswith(allowed)]


@pytest.mark.parametrize("script", sorted(OWN_LINES))
def test_every_script_tells_the_same_training_story(script):
    assert drifted_lines(script, (SCRIPTS / script).read_text()) == []


def test_a_change_to_one_script_alone_is_caught():
    source = (SCRIPTS / "cpu_gloo.py").read_text()
    changed = source.replace("accelerator.backward(loss)", "loss.backward()")
    assert changed != source
    assert [(line[0], line[2:].strip()) for line in drifted_lines("cpu_gloo.py", changed)] == [
        ("-", "accelerator.backward(loss)"), ("+", "loss.backward()")]
    moved = source.replace("                    optimizer.zero_grad()\n", "                optimizer.zero_grad()\n")  # out of accumulate()'s block
    assert moved != source and [(line[0], line[2:].strip()) for line in drifted_lines("cpu_gloo.py", moved)] == [
        ("-", "optimizer.zero_grad()"), ("+", "optimizer.zero_grad()")]
