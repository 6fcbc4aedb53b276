"""Runs a training script whose every ReLU, while gradients are on (training), is followed by dropout (p 0.3),
as a copy of a template may add: its steps then draw from torch's random state, which a checkpoint holds.

    python tests/probes/with_dropout.py scripts/mnist_conv.py --output_dir ...
"""

import runpy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

relu, dropped = F.relu, []


def relu_then_dropout(x, *args, **kwargs):
    if torch.is_grad_enabled() and not dropped:
        dropped.append(True)
    return torch.dropout(relu(x, *args, **kwargs), 0.3, torch.is_grad_enabled())


F.relu = relu_then_dropout
sys.argv = sys.argv[1:]
sys.path[0] = str(Path(sys.argv[0]).resolve().parent)  # the script's own folder, as `python script.py` has it
runpy.run_path(sys.argv[0], run_name="__main__")
if not dropped:  # a script that calls ReLU another way would make the test's resume one without dropout
    sys.exit(f"with_dropout.py: {sys.argv[0]} trained without calling torch.nn.functional.relu: no dropout was added")
