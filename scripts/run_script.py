"""How scripts/launch.py starts each training process: `python run_script.py SCRIPT ARGS...` runs SCRIPT as
`python SCRIPT ARGS...` would, except that a Ctrl-C that comes before the script handles its own (while it
imports torch, the first seconds) ends the process in exit 130 and one line, not in a traceback from each process."""

import os
import sys

try:
    import runpy  # inside the try: the Ctrl-C may come even now

    script = sys.argv.pop(1)
    sys.argv[0] = script
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # the script's own folder, where `python SCRIPT` looks first
    runpy.run_path(script, run_name="__main__")
except KeyboardInterrupt:
    if os.environ.get("RANK", "0") == "0":  # the others are stopping too: one line, as the scripts' own handler says it
        print("Stopped by Ctrl-C.", file=sys.stderr, flush=True)
    os._exit(130)  # at once, as the scripts' own handler: the interpreter may be half way through importing torch
