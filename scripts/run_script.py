"""How scripts/launch.py starts each training process: `python run_script.py SCRIPT ARGS...` runs SCRIPT as
`python SCRIPT ARGS...` would, except that a Ctrl-C that no handler of the script's catches (while it imports
torch, the first seconds) ends the process in exit 130 and one line, not in a traceback from each process;
SHOW_TRACEBACK=1 prints the traceback too, to see where a run was stuck."""

import os
import sys

try:
    import runpy  # inside the try: the Ctrl-C may come even now

    script = sys.argv.pop(1)
    sys.argv[0] = script
    if not sys.flags.safe_path:  # the script's own folder first, where `python SCRIPT` puts it (its links resolved)
        sys.path[0] = os.path.dirname(os.path.realpath(script))
    runpy.run_path(os.path.abspath(script), run_name="__main__")  # an absolute __file__, as __main__'s is
except KeyboardInterrupt:
    import signal
    import traceback

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the exit
    if os.environ.get("SHOW_TRACEBACK") == "1":
        traceback.print_exc()
    if os.environ.get("RANK", "0") == "0":  # the others are stopping too: one line, as the scripts' own handler says it
        print("Stopped by Ctrl-C.", file=sys.stderr, flush=True)
    sys.exit(130)
