"""Runs a training script with shared.checkpoint_digests recording which process hashed which file:
each process appends "<saved or checked> <file>" lines to <HASH_LOG>/rank<RANK>.txt.

    HASH_LOG=folder python tests/probes/who_hashes.py scripts/cpu_gloo.py --checkpointing_steps 20 ...
"""

import os
import runpy
import sys
from pathlib import Path

from shared import checkpoint_digests

log = Path(os.environ["HASH_LOG"]) / f"rank{os.environ.get('RANK', '0')}.txt"
original_sha256 = checkpoint_digests._sha256


def sha256_and_say_so(path):
    with log.open("a") as file:
        file.write(f"{'checked' if (path.parent / 'trainer_state.json').exists() else 'saved'} {path.name}\n")
    return original_sha256(path)


checkpoint_digests._sha256 = sha256_and_say_so
sys.argv = sys.argv[1:]
sys.path[0] = str(Path(sys.argv[0]).resolve().parent)  # the script's own folder, as `python script.py` has it
runpy.run_path(sys.argv[0], run_name="__main__")
