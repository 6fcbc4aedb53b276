"""A training script in the seconds it spends importing torch, before its own Ctrl-C handler is in place: it
writes ready_<rank> into the folder its argument names, then waits, as the import would, for the test's Ctrl-C."""

import os
import sys
import time
from pathlib import Path

(Path(sys.argv[1]) / f"ready_{os.environ.get('RANK', '0')}").touch()
time.sleep(60)
