"""The tests' fork server: `python fork_server.py FOLDER` imports what the training processes import,
then forks a child per `python ARGS` that fork_client.py asks for, so that the few hundred processes
a suite starts skip the 4 s of CPU that each new interpreter spends importing torch, accelerate and
the torch._dynamo that an optimizer's first step imports (benchmarks/README.md#start-up).

A fork stands in for a new interpreter only where it would run the same: the client's namespaces
(`ip netns exec` gives another network), resource limits, capabilities (setpriv drops some), user
and import-time environment (fork_client.IMPORT_TIME_ENV) must be this server's, and the command `[-u] [-B]` followed by
`script.py`, `-m module` or `-c code`; otherwise the client starts a new interpreter. The child takes
the client's open files (at their numbers), folder, umask, CPU set and environment, runs the command
as __main__ and ends as the interpreter would: its exit code, the traceback of an uncaught exception,
killed by SIGINT after an uncaught KeyboardInterrupt; non-daemon threads joined, then the exit
handlers. What differs from a new interpreter:
- the interpreter's final clean-up of every module is skipped, so a crash that only happens there is
  seen only by tests that start new interpreters (test_forked_runs.py, the smoke tier run on its own,
  the GPU tier);
- sys.flags are the server's (`-B` sets sys.dont_write_bytecode alone), so multiprocessing's spawn
  in a fork passes the server's flags on;
- the fork's parent is this server, not the client's parent: a fork that asks to be signalled when its
  parent dies (torch.multiprocessing's spawned workers do) outlives its client's parent, until the
  client ends or the tests stop the servers.
"""

import atexit
import fcntl
import gc
import importlib
import io
import json
import os
import resource
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import traceback
import types

from fork_client import inherited_fds, server_socket

PRELOADED = ("torch", "torch._dynamo", "torch.distributed.run", "accelerate", "accelerate.commands.launch", "safetensors.torch",
             "tqdm.auto")
NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "user", "uts")
LIMITS = [getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_")]
MAX_FDS = 64  # files passed on from the client; more than that and it starts a new interpreter
SKIPPED_FRAMES = ("<frozen runpy>", runpy.__file__, os.path.abspath(__file__))  # the frames before the command's own
FORKED_LOG = "forked.jsonl"  # in the servers' folder: the command of every fork, a line each (conftest.forked_commands)


def serve(folder):
    for name in PRELOADED:
        importlib.import_module(name)
    assert threading.active_count() == 1, "forks of a process with threads may deadlock"
    gc.freeze()  # the collector then leaves the imported objects alone, so forks do not copy their pages
    assert inherited_fds() == [0, 1, 2], "a fork puts its client's files at their numbers: none may be the server's"
    path = server_socket(folder, os.environ)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".starting")
    listener.listen(128)
    os.rename(path + ".starting", path)  # clients find the socket only once it accepts
    forks = {}  # pidfd -> (pid, the client's connection; None once the client is gone and the fork killed)
    parent = os.getppid()
    try:
        while os.getppid() == parent:  # ends with the test process that started it
            clients = {connection: pidfd for pidfd, (_, connection) in forks.items() if connection is not None}
            ready, _, _ = select.select([listener, *forks, *clients], [], [], 1)
            for item in ready:
                try:
                    if item is listener:
                        accept(listener, forks, os.path.join(folder, FORKED_LOG))
                    elif item in forks:
                        report_end(item, forks)
                    elif forks.get(clients[item], (None, None))[1] is item:  # (not ended in this pass)
                        check_client(item, clients[item], forks)
                except Exception:  # one client's trouble never ends the server
                    traceback.print_exc()
    finally:
        for pid, _ in forks.values():
            os.kill(pid, signal.SIGKILL)


def accept(listener, forks, log):
    connection, _ = listener.accept()
    try:
        own_files = [listener, *forks, *(client for _, client in forks.values() if client is not None)]
        pid = start(connection, own_files, log)
    except BaseException:
        connection.close()
        raise
    if pid is None:
        connection.close()
        return
    try:
        forks[os.pidfd_open(pid)] = pid, connection
    except OSError:  # out of files: a fork nobody watches must not run
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        connection.close()
        raise


def report_end(pidfd, forks):
    """A fork ended: tell its client how."""
    pid, connection = forks.pop(pidfd)
    exit_code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os.close(pidfd)
    if connection is not None:
        reply(connection, {"exit_code": exit_code})
        connection.close()


def check_client(connection, pidfd, forks):
    """The client's connection is readable: at its end (the client was killed), kill its fork, which
    report_end then reaps."""
    try:
        gone = not connection.recv(1)
    except OSError:  # reset: the client was killed before it read the fork's pid
        gone = True
    if gone:
        pid, _ = forks[pidfd]
        os.kill(pid, signal.SIGKILL)
        forks[pidfd] = pid, None
        connection.close()


def reply(connection, message):
    try:
        connection.sendall(json.dumps(message).encode() + b"\n")
    except OSError:  # the client is gone
        pass


def start(connection, own_files, log):
    """Read the request; fork the command's process and tell the client its pid, or tell the client to
    start a new interpreter. The fork's pid, or None. `own_files`: the server's, which the fork closes;
    `log`: the file the fork's command is appended to."""
    connection.settimeout(5)  # a client sends its request as soon as it connects
    header, fds, _, _ = socket.recv_fds(connection, 4, MAX_FDS)
    try:
        with connection.makefile("rb") as replies:  # closed before the fork, whose close of the connection then closes it
            header += replies.read(4 - len(header))
            request = json.loads(replies.read(struct.unpack("!I", header)[0]))
        peer, uid, gid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        command = parse_command(request["argv"])
        if (command is None or len(fds) != len(request["fds"]) or not {0, 1, 2} <= set(request["fds"])
                or max(request["fds"]) + 2 * MAX_FDS >= resource.getrlimit(resource.RLIMIT_NOFILE)[0]  # room for place_files
                or (uid, gid) != (os.getuid(), os.getgid()) or not same_context(peer)):
            reply(connection, {"new_interpreter": True})
            return None
        # Logged before the fork: a fork whose line could not be written would run unwatched, and the command twice.
        with open(log, "a") as forked:  # one short write in append mode: the servers' lines never mix
            forked.write(json.dumps(request["argv"]) + "\n")
        pid = os.fork()
        if pid == 0:  # become() ends with the command's exit code; any other way out of it ends the fork here
            try:
                try:
                    for item in [connection, *own_files]:
                        os.close(item) if isinstance(item, int) else item.close()
                    become(request, fds, peer, *command)
                except BaseException:
                    traceback.print_exc()
            finally:  # never back into the server's loop, not even when the report fails (a closed stderr)
                os._exit(1)
    finally:
        for fd in fds:
            os.close(fd)
    reply(connection, {"pid": pid})
    connection.settimeout(None)
    return pid


def parse_command(argv):
    """(options, kind, target, args) for `[-u] [-B] script.py|-m module|-c code ARGS`; None for anything else.
    (-B is among the flags that multiprocessing's spawn passes on to its children.)"""
    options = set()
    while argv[:1] in (["-u"], ["-B"]):
        options.add(argv[0])
        argv = argv[1:]
    if len(argv) >= 2 and argv[0] in ("-m", "-c"):
        return options, argv[0], argv[1], argv[2:]
    if argv and argv[0].endswith(".py") and not argv[0].startswith("-"):
        return options, "script", argv[0], argv[1:]
    return None


def same_context(peer):
    try:
        return (all(os.readlink(f"/proc/{peer}/ns/{name}") == os.readlink(f"/proc/self/ns/{name}") for name in NAMESPACES)
                and all(resource.prlimit(peer, limit) == resource.getrlimit(limit) for limit in LIMITS)
                and capabilities(peer) == capabilities("self"))
    except OSError:
        return False


def capabilities(pid):
    """A process's capability sets: a client without root's (setpriv) must not get a fork that has them."""
    with open(f"/proc/{pid}/status") as status:
        return [line for line in status if line.startswith("Cap")]


def become(request, fds, peer, options, kind, target, args):
    """In the fork: take the client's place and run the command as __main__; exits."""
    place_files(fds, request["fds"])
    os.chdir(request["cwd"])
    os.umask(int(next(line for line in open(f"/proc/{peer}/status") if line.startswith("Umask:")).split()[1], 8))
    os.sched_setaffinity(0, os.sched_getaffinity(peer))
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = "-u" in options or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.dont_write_bytecode = "-B" in options or bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    sys.stdout = sys.__stdout__ = output_stream(1, unbuffered, line_buffering=False, errors="strict")
    sys.stderr = sys.__stderr__ = output_stream(2, unbuffered, line_buffering=True, errors="backslashreplace")
    exit_code = run_as_main(kind, target, args)
    threading._shutdown()  # as the interpreter does at its end: wait for non-daemon threads
    atexit._run_exitfuncs()  # those of the imports the server made for it, and its own
    sys.stdout.flush()
    sys.stderr.flush()
    if exit_code == "KeyboardInterrupt":  # the interpreter ends such a run killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(exit_code)


def place_files(received, numbers):
    """Give the client's files the numbers they had there (received ones may sit on those numbers)."""
    above = max([*received, *numbers]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in received]
    for fd in received:
        os.close(fd)
    for fd, number in zip(moved, numbers):
        os.dup2(fd, number)
        os.close(fd)


def output_stream(fd, unbuffered, line_buffering, errors):
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8", errors=errors,
                            line_buffering=line_buffering and not unbuffered, write_through=unbuffered)


def run_as_main(kind, target, args):
    """Run the command as __main__; the exit code the interpreter would give."""
    try:
        if kind == "script":
            sys.argv, sys.path[0] = [target, *args], os.path.dirname(os.path.realpath(target))
            runpy.run_path(target, run_name="__main__")
        elif kind == "-m":
            sys.argv, sys.path[0] = [target, *args], os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = ["-c", *args], ""
            main = sys.modules["__main__"] = types.ModuleType("__main__")
            exec(compile(target, "<string>", "exec"), main.__dict__)
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            return exit.code or 0
        print(exit.code, file=sys.stderr)
        return 1
    except BaseException as error:
        frames = error.__traceback__
        while frames is not None and frames.tb_frame.f_code.co_filename in SKIPPED_FRAMES:
            frames = frames.tb_next
        sys.excepthook(type(error), error.with_traceback(frames), frames)
        return "KeyboardInterrupt" if isinstance(error, KeyboardInterrupt) else 1
    return 0


if __name__ == "__main__":
    serve(sys.argv[1])
