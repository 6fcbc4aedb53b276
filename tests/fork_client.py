"""`python ARGS` for the tests, as a fork of a fork server (fork_server.py) that has already imported
torch and accelerate, or as a new interpreter where no server can stand in for one.

conftest.py writes an executable `python` that runs this file with `-S -E` (the standard library
only, a few milliseconds) and hands it to the scripts as PYTHON_EXEC, torchrun's executable for the
training processes. This process stays the one its launcher started and watches: it passes its open
files (its standard streams and any other its launcher passed on), arguments, environment and folder
to the server, forwards the signals it gets to the fork, and ends as the fork ended (its exit code, or
killed by the same signal). If it is killed itself, the server kills the fork.
"""

import hashlib
import json
import os
import select
import signal
import socket
import struct
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# Read when torch, OpenMP, tqdm (its TQDM_* defaults) or accelerate (HF_HOME: its default config file) are
# imported: a fork has the server's values.
IMPORT_TIME_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_CPP_LOG_LEVEL", "CUDA_VISIBLE_DEVICES", "PYTHONPATH",
                   "PYTHONHASHSEED", "PYTHONWARNINGS", "LD_PRELOAD", "LD_LIBRARY_PATH", "HF_HOME")


def server_socket(folder, environ):
    """The socket of the server whose import-time environment is environ's."""
    tqdm_defaults = sorted((name, value) for name, value in environ.items() if name.startswith("TQDM_"))
    values = json.dumps([[environ.get(name) for name in IMPORT_TIME_ENV], tqdm_defaults]).encode()
    return os.path.join(folder, hashlib.sha1(values).hexdigest()[:16] + ".sock")


def inherited_fds():
    """The numbers of the files this process was started with: its streams, and any others its
    launcher passed on (torch.multiprocessing's spawn passes a pipe's end, for instance)."""
    listed = [int(name) for name in os.listdir("/proc/self/fd")]  # one of them was the listing's own
    return sorted(fd for fd in listed if is_open(fd))


def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def read_line(connection, data, wakeup=None, pid=None):
    """The next line the server sends (None if it closed first), and what came after it. With `wakeup`,
    each signal this process got meanwhile (Python's C-level handler writes its number there at once, even
    one that lands just before a blocking call) is passed on to the fork `pid`."""
    while b"\n" not in data:
        if wakeup is not None:
            ready, _, _ = select.select([connection, wakeup], [], [])
            if wakeup in ready:
                for signum in os.read(wakeup, 512):
                    if signum in FORWARDED:
                        try:
                            os.kill(pid, signum)
                        except ProcessLookupError:
                            pass
            if connection not in ready:
                continue
        chunk = connection.recv(4096)
        if not chunk:
            return None, b""
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line, rest


def main():
    python, argv = sys.argv[1], sys.argv[2:]
    wakeup, wakeup_writer = os.pipe()  # close-on-exec, as every file Python opens
    os.set_blocking(wakeup_writer, False)
    signal.set_wakeup_fd(wakeup_writer)
    for signum in FORWARDED:  # caught, so that they do not end this process; passed on by read_line
        signal.signal(signum, lambda *_: None)
    try:
        # Passed on, and kept open here until the end: a parent may watch one for the end of the process it
        # started (multiprocessing's spawn watches a pipe's end so). Not the wakeup pipe, this process's own.
        fds = [fd for fd in inherited_fds() if fd not in (wakeup, wakeup_writer)]
        connection = socket.socket(socket.AF_UNIX)
        connection.connect(server_socket(os.environ["FORK_SERVER_DIR"], os.environ))
        request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds}).encode()
        socket.send_fds(connection, [struct.pack("!I", len(request))], fds)
        connection.sendall(request)
        line, rest = read_line(connection, b"")
        reply = json.loads(line) if line is not None else {"new_interpreter": True}
    except (OSError, KeyError):  # no server for this environment
        reply = {"new_interpreter": True}
    if reply.get("new_interpreter"):  # exec sets the handlers back to the default, and closes the wakeup pipe
        os.execv(python, [python, *argv])
    pid = reply["pid"]
    line, _ = read_line(connection, rest, wakeup, pid)  # signals that came before the pid was known wait in the pipe
    if line is None:  # the server was stopped (at the end of the tests) before the fork ended
        sys.exit(f"fork_client.py: the fork server stopped before its fork ({pid}) of {argv} ended")
    end = json.loads(line)
    if end["exit_code"] < 0:  # killed by a signal: end the same way
        signum = -end["exit_code"]
        if signum != signal.SIGKILL:  # a handler of this process's (Python ignores SIGPIPE) must not catch it
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
    os._exit(end["exit_code"] & 0xFF)


if __name__ == "__main__":
    main()
