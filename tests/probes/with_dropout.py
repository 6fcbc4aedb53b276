"""Runs a training script whose every ReLU, while gradients are on (training), is followed by dropout (p 0.3),
as a copy of a template may add: its steps then draw from torch's random state, which a checkpoint holds.

    python tests/probes/with_dropout.py scripts/mnist_conv.py --output_dir ...
"""

import runpy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

relu = F.relu
F.relu = lambda x, *args, **kwargs: torch.dropout(relu(x, *args, **kwargs), 0.3, torch.is_grad_enabled())
sys.argv = sys.argv[1:]
sys.path[0] = str(Path(sys.argv[0]).resolve().parent)  # the script's own folder, as `python script.py` has it
runpy.run_path(sys.argv[0], run_name="__main__")
