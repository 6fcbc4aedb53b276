"""`accelerate launch` with one-sentence errors: the same arguments, the same launcher.

    python scripts/launch.py --config_file accelerate_configs/cpu.yaml scripts/cpu_gloo.py --num_epochs 3

Before starting anything it checks the profile (that it exists, that it parses, and that a profile
asking for GPUs finds some) and, for the training scripts beside it, their flags, so a mistake is
answered at once instead of after every process has started. With a CPU profile (use_cpu: true) it
tells every process to use the CPU, so any Accelerate script, one that builds a plain Accelerator()
too, joins one gloo group (plain `accelerate launch` leaves each process alone at world size 1).
With --max_restarts, every restart gets a rendezvous store of its own (one machine or several).
Then it runs accelerate's own launcher in this process. A training process that fails has already
printed its one-sentence error, so torchrun's report and traceback and the processes' C++ warnings
are left out; a process killed from outside gets one line saying which rank stopped, and with
--max_restarts each restart gets one line. SIGTERM and SIGUSR1 (a cluster's warning) reach the
training processes, which save and stop, also where accelerate runs one process without torchrun; one
that comes while the launcher starts or the launch waits for the other machines ends it at once.
Exits 1 on failure (a save after a signal to stop too), 143 after a signal to stop (SIGTERM or SIGUSR1:
with checkpointing, once every process saved, or after a line saying that the launcher killed them first, or
that they ended at once, saving nothing; 0 where it came after their last check and the run finished),
130 after Ctrl-C (in one line, also while the processes import torch: each starts through run_script.py).
Under --max_restarts, a process that a mistake stopped ends the run: every start would meet it again.
"""

import copy
import importlib.util
import ipaddress
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def stopped_while_starting(signum, frame):
    """A signal in the 2 s of imports and checks below: one line and its code, not a traceback (Ctrl-C) nor the death
    by SIGUSR1 (exit 138, which SLURM's batch script does not requeue). main() gives each signal its handler."""
    if signum == signal.SIGINT:
        print("Stopped by Ctrl-C.", file=sys.stderr, flush=True)
        os._exit(130)
    print(f"Stopped by {signal.Signals(signum).name} while the launcher started: nothing trained; resume with "
          "--resume_from_checkpoint latest if the run saved checkpoints.", file=sys.stderr, flush=True)
    os._exit(143)


if __name__ == "__main__":
    for early_signal in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(early_signal, stopped_while_starting)

# torch's C++ log, whose level is read as torch loads: the launcher's says nothing its one sentence does not
# (a rendezvous that cannot connect logs a C++ stack for each try). A level you set wins; main() sets the
# training processes'.
CPP_LOG_LEVEL = os.environ.get("TORCH_CPP_LOG_LEVEL")
os.environ["TORCH_CPP_LOG_LEVEL"] = CPP_LOG_LEVEL or "FATAL"

from accelerate.commands.config.config_args import default_config_file, load_config_from_file
import accelerate.commands.launch as accelerate_launch
from accelerate.commands.launch import launch_command, launch_command_parser
from accelerate.utils import ComputeEnvironment, is_fp8_available, prepare_simple_launcher_cmd_env
from torch.distributed import DistError
from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError, RendezvousTimeoutError

from shared.devices import require_gpus
from shared.errors import LOST_PEER_EXIT_CODE, STOPPED_EXIT_CODE, UserError, exit_now, first_line, print_traceback_if_asked
from shared.preemption import signal_numbers

if CPP_LOG_LEVEL is None:  # the environment as it was (a test imports this module)
    del os.environ["TORCH_CPP_LOG_LEVEL"]

HERE = Path(__file__).resolve().parent


RESUME_IF_SAVED = "Resume with --resume_from_checkpoint latest if the run saved checkpoints."  # after a run that stopped


def fail(sentence):
    print(f"error: {sentence}", file=sys.stderr, flush=True)
    sys.exit(1)


def check_profile(path, cpu_flag):
    """The profile's settings; stops with a sentence if it is missing, broken, or asks for absent GPUs."""
    try:
        config = load_config_from_file(path)
    except FileNotFoundError:
        fail(f"Profile {path} does not exist: pass one of the files in accelerate_configs/ to --config_file.")
    except Exception as error:  # YAML and accelerate's own checks raise many kinds
        reason = " ".join(str(error).split())[:200]
        fail(f"Profile {path} could not be read ({reason}): fix it, or write a new one with `accelerate config --config_file {path}`.")
    for name in ("num_processes", "num_machines", "machine_rank", "main_process_port"):  # else accelerate's TypeError, later
        value = getattr(config, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            fail(f"Profile {path} has {name}: {value!r}, which is no whole number: fix it, or write a new one with "
                 f"`accelerate config --config_file {path}`.")
    if not (config.use_cpu or cpu_flag):
        try:
            require_gpus(f"Profile {path} asks for GPUs ({config.distributed_type}, {config.num_processes} processes)")
        except UserError as error:
            fail(str(error))
    return config


def template_launched(args):
    """The path of the training script where it is one of the templates beside this launcher, else None (a script of
    your own, a module)."""
    path = None if args.module or args.no_python else Path(args.training_script).resolve()
    return path if path and path.parent == HERE and path != Path(__file__).resolve() else None


def check_script_flags(path, script_args):
    """The flags of a template (template_launched), parsed here before any process starts (each process
    would first spend seconds importing torch). Prints --help and stops, or stops with the script's own
    sentence for a bad flag."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the scripts train only under `if __name__ == "__main__"`

    program, sys.argv[0] = sys.argv[0], str(path)  # the script's own name in its messages
    try:
        module.parse_args(script_args)
    except UserError as error:
        print_traceback_if_asked()
        fail(str(error))
    finally:
        sys.argv[0] = program


class TorchrunLog(logging.Handler):
    """Reads torchrun's log: a failed process and the restart of the run become one line per restart,
    and the processes torchrun itself stops are remembered (they are never the cause of a failure)."""

    def __init__(self, machines=1):
        super().__init__()
        self.machines = machines
        self.failed = None
        self.stopped_by_torchrun = set()  # their pids
        self.waiting = False  # under torchrun, until it starts this machine's processes, and while it restarts them
        self.stopping_after_a_failure = False  # torchrun stops the others after a process failed, before a restart or the end
        self.started = False  # whether this machine's processes have started: it then reached machine 0 once

    def emit(self, record):
        try:
            self.say(record)
        except SignalException:  # a signal to stop that lands here is torchrun's to handle, not a logging error to swallow
            raise
        except Exception:  # noqa: BLE001  a log handler must never stop the launcher
            self.handleError(record)

    def say(self, record):
        message = record.getMessage()
        if message.startswith("failed (exitcode"):
            if self.failed is None:  # the first to fail is the lost one; the others stopped because of it
                exitcode, local_rank = record.args[0], record.args[1]
                self.failed = f"process {local_rank} {how_it_ended(exitcode)}"
        elif "attempts left; will restart worker group" in message:  # a process of this machine failed
            left, total = record.args[2], record.args[3]
            print(f"Restarting the run ({total - left + 1} of {total} restarts): {self.failed or 'a process failed'}; "
                  "it resumes from its newest checkpoint.", file=sys.stderr, flush=True)
            self.failed = None
            self.stopped_by_torchrun.clear()  # a failure torchrun reports is of the newest start only
        elif "Rendezvous'ing worker group" in message:  # at the start and at each restart, when no process runs
            self.waiting = True
        elif "Starting worker group" in message:
            self.waiting, self.started, self.stopping_after_a_failure = False, True, False
        elif stopping := re.match(r"Sending process (\d+) closing signal", message):
            self.stopped_by_torchrun.add(int(stopping[1]))
            # torchrun's own stop once a process failed, not the stop that a signal to this launcher began (in the signal's handler)
            self.stopping_after_a_failure |= not isinstance(sys.exc_info()[1], SignalException)
        elif "new nodes from group_rank" in message:  # another machine restarts: this one joins it
            print("Restarting this machine's processes to rejoin another machine's restarted ones; "
                  "they resume from the newest checkpoint.", file=sys.stderr, flush=True)

    def while_waiting(self):
        """What the launch was doing while `waiting`, for end_while_waiting's line."""
        if self.machines > 1:
            return "the launch waited for the other machines, with no training process running here"
        return "the launch was starting its training processes, none of them running yet"


def stopped(what, exitcode):
    """Exit code 1 means the process already printed why (its one-sentence error, or a bug's traceback);
    143, that the run saved a checkpoint on a signal to stop and said where."""
    if exitcode in (1, STOPPED_EXIT_CODE):
        sys.exit(exitcode)
    fail(f"Training stopped: {what}. {RESUME_IF_SAVED}")


def cause_of_failure(failures, stopped_by_torchrun):
    """The rank and failure that stopped the run: the first process torchrun saw end (its failures are
    in that order) that it did not stop itself, and that was not a survivor leaving because another
    process was lost. torchrun's own first failure goes by whole seconds, so a survivor may tie with it."""
    ended_on_their_own = [(rank, failure) for rank, failure in failures.items() if failure.pid not in stopped_by_torchrun]
    causes = [(rank, failure) for rank, failure in ended_on_their_own if failure.exitcode != LOST_PEER_EXIT_CODE]
    return (causes or ended_on_their_own or list(failures.items()))[0]


def how_it_ended(exitcode):
    if exitcode == -6:  # an abort in C++; NCCL's watchdog ends a process whose collective waited --ddp_timeout in vain this way
        return ("was killed by signal 6 (SIGABRT: an abort in PyTorch's C++ code; under NCCL, its watchdog after a collective "
                "waited --ddp_timeout for another process)")
    if exitcode < 0:
        return f"was killed by signal {-exitcode}"
    if exitcode == LOST_PEER_EXIT_CODE:
        return "lost the connection to another process of the run (that process ended, or the network to its machine failed)"
    return f"exited with code {exitcode}"


def one_process_launcher(args):
    """accelerate's simple_launcher, which runs one process without torchrun (1gpu.yaml, --num_processes
    1), but handling signals as torchrun does: the process runs in a session of its own, and SIGTERM
    (Kubernetes, scancel), SIGUSR1 (SLURM's --signal) and SIGINT (Ctrl-C) to this launcher are passed
    on to it, which saves (with checkpointing) and stops; SIGHUP (a lost terminal or SSH session) and
    SIGQUIT too, which end it as they would have without a session of its own, and as torchrun passes them
    on. accelerate's own handles none: SIGTERM ended the launcher at once, leaving the process orphaned,
    to train on or be killed before it could save. As torchrun, it kills the process (its session) once
    args.shutdown_timeout has passed since the first signal, so that a save that hangs still ends the job."""
    command, env = prepare_simple_launcher_cmd_env(args)
    process = subprocess.Popen(command, env=env, start_new_session=True)
    passed_on, first_at = [], []

    def pass_on(signum, frame):
        passed_on.append(signum)
        first_at[:] = first_at or [time.monotonic()]
        process.send_signal(signum)  # nothing, once the process has ended

    for stop_signal in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):  # torchrun's, below
        signal.signal(stop_signal, pass_on)
    killed = False
    while process.poll() is None:
        try:
            process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            if first_at and time.monotonic() - first_at[0] > args.shutdown_timeout:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                    killed = True
                except ProcessLookupError:  # reaped meanwhile, by a later signal's handler
                    pass
    # Stopped by the signal, after the save it asked for, or killed after the wait: the launcher exits as under torchrun.
    if passed_on and (killed or process.returncode in (-passed_on[-1], 128 + passed_on[-1], STOPPED_EXIT_CODE)):
        EXIT_CODES_AT_SHUTDOWN[:], SHUTDOWN_SECONDS[:] = [process.returncode], [time.monotonic() - first_at[0]]
        raise SignalException(f"the process stopped on signal {passed_on[-1]}", signal.Signals(passed_on[-1]))
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
ENDING = threading.Lock()


def stop_at_once_while_waiting(torchrun_log):
    """SIGTERM, SIGUSR1 or Ctrl-C while torchrun waits for the other machines, before it starts this
    machine's processes or restarts them, ends the launch in about a second with one line and 143 (Ctrl-C:
    130), which the SLURM script requeues. Without this, SIGUSR1 killed the launcher (138) before torchrun's
    handlers were installed, and a rendezvous blocked in C++ (a connect to machine 0, a wait on the
    store), where no Python handler runs, heard no signal until it timed out. A thread woken by the signal
    (Python's C-level handler writes its number to the wakeup fd even then) ends it where the main thread
    has not."""
    def stop(signum, frame):  # where the main thread runs Python, as torchrun's own handler: main() ends the launch
        raise SignalException(f"the launcher got signal {signum}", signal.Signals(signum))

    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, stop)
    threading.Thread(target=end_if_stuck_waiting, args=(signal_numbers()[0], torchrun_log), daemon=True).start()


def end_if_stuck_waiting(reader, torchrun_log):
    while True:
        signum = reader.recv(1)[0]
        if signum in STOP_SIGNALS and torchrun_log.waiting:
            time.sleep(1)  # where the main thread runs Python, its handler ends the launch meanwhile
            if torchrun_log.waiting and not has_child_process():  # none to orphan: none has started
                end_while_waiting(signum, torchrun_log.while_waiting())


def end_while_waiting(signum, during):
    with ENDING:  # once, from the main thread or the signal's thread, whichever comes first
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"Stopped by {name} while {during}: nothing trained since the newest checkpoint; resume with "
              "--resume_from_checkpoint latest if the run saved checkpoints.", file=sys.stderr, flush=True)
        exit_now(STOPPED_EXIT_CODE if signum in (signal.SIGTERM, signal.SIGUSR1) else 128 + signum)  # SIGHUP's 129: no requeue


def has_child_process():
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)  # WNOWAIT: reaps none, torchrun does
        return True
    except ChildProcessError:
        return False


def use_a_fresh_rendezvous_for_every_restart(args, setting):
    """The profiles' static rendezvous and torchrun's shared c10d store both keep one store for the
    whole job, where a restarted process reads the gloo address of a process that died and fails to
    connect (torch 2.15). Here every restart gets a store of its own."""
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if (setting("num_machines") or 1) == 1:
        args.standalone = True  # torchrun's own c10d rendezvous on this machine
        return
    # torchrun's c10d rendezvous at --main_process_ip:--main_process_port, not its static one. Machine
    # 0 hosts its store and is known at --main_process_ip (torchrun would guess both from the host
    # name, which may resolve to another of its addresses).
    args.rdzv_backend = "c10d"
    args.same_network = False  # with it, accelerate gives c10d no endpoint and every machine would host its own
    is_host = setting("machine_rank") == 0
    args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, f"is_host={int(is_host)}"]))
    if is_host:
        args.local_addr = setting("main_process_ip")
    else:  # the machine that ranks first hosts the processes' store at the address it advertises
        args.local_addr = getattr(args, "local_addr", None) or address_toward(setting("main_process_ip"))


def address_toward(main_process_ip):
    """What another machine advertises to the rendezvous: torchrun's guess, its host name, unless that name means this
    machine alone (`localhost` on some images) where machine 0 is elsewhere; then the address of its interface toward
    machine 0. torchrun ranks the machines by that name, and where this one ranks first, the others would connect to
    themselves. None: torchrun's guess."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(main_process_ip)).is_loopback:
            return None  # every machine on this one (loopback): its name reaches it
        if not ipaddress.ip_address(socket.gethostbyname(socket.getfqdn())).is_loopback:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((main_process_ip, 9))  # sends nothing: the kernel picks the route, and with it this end's address
            return probe.getsockname()[0]
    except OSError:  # no route, or a name that does not resolve: the rendezvous says so in its own words
        return None


def no_restart_after_a_mistake():
    """torchrun restarts the run after any failed process while --max_restarts allow it. A process that a
    mistake ended (a full disk, a diverged loss) wrote the mistake to its error file (shared/errors.py), and
    every start would end the same way: no restarts are left after it, as torch's agent does itself for a
    process stuck in the kernel. An exit code of 1 alone cannot tell: a crash that a restart gets past (a
    DataLoader worker killed for memory) exits 1 too. Nor is a run restarted whose processes saved and stopped on
    a signal to stop (exit 143), which another machine's launcher alone may have got: the run was told to end."""
    monitor = LocalElasticAgent._monitor_workers

    def monitor_workers(agent, worker_group):
        result = monitor(agent, worker_group)
        if any(map(ends_the_run, result.failures.values())):
            agent._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = monitor_workers


def ends_the_run(failure):
    """Whether a process's end leaves no restart: a mistake (its error file holds a UserError), or a stop on a signal (143).
    A process that torchrun stops after another failed does not end in 143: blocked in a collective with the lost one,
    torchrun kills it 30 s on, before preemption's watchdog would end it (Preemption.GRACE_S)."""
    return failure.exitcode == STOPPED_EXIT_CODE or isinstance(failure.message, str) and failure.message.startswith(f"{UserError.__name__}: ")


EXIT_CODES_AT_SHUTDOWN = []
SHUTDOWN_SECONDS = []  # how long the newest shutdown took: its whole wait, and torchrun killed the processes left
A_RESTART_WAS_DUE = []  # at the newest shutdown: restarts were left, and what torchrun's monitor had found asked for one


def remember_how_the_processes_ended():
    """On a signal to stop, torchrun passes it on, waits for the processes to end and raises SignalException,
    which says nothing of how they ended; kept here: a process that exited 1 failed to save (and said why),
    unless it had failed before, when a restart was due (A_RESTART_WAS_DUE). Each restart shuts the processes
    of the start before down too: only the newest shutdown's are kept."""
    shutdown = LocalElasticAgent._shutdown

    def shutdown_and_remember(agent, *args, **kwargs):
        started = time.monotonic()
        shutdown(agent, *args, **kwargs)
        SHUTDOWN_SECONDS[:] = [time.monotonic() - started]
        handlers = getattr(agent._pcontext, "subprocess_handlers", {})
        EXIT_CODES_AT_SHUTDOWN[:] = [handler.proc.returncode for handler in handlers.values()]
        failures = getattr(agent._pcontext, "_failures", {}).values()  # found before this shutdown, where one failed first
        A_RESTART_WAS_DUE[:] = [agent._remaining_restarts > 0 and not any(map(ends_the_run, failures))]

    LocalElasticAgent._shutdown = shutdown_and_remember


def accelerates_launcher(args):
    """Which launcher accelerate will use, by its own reading of the command line, the profile, and without one its
    default config or the GPUs, in launch_command's order: whether it runs torchrun (a multi-GPU, FSDP or DeepSpeed
    launch, not --cpu), and whether each process runs `python SCRIPT`, as under torchrun or the one-process launcher
    (not DeepSpeed's, a TPU's or SageMaker's launcher)."""
    accelerate_launch.logger.disabled = True  # its notes on defaults come when it launches
    try:
        launch, defaults, _ = accelerate_launch._validate_launch_command(copy.deepcopy(args))
    except (ValueError, ConnectionError) as error:
        fail(f"{error} ")
    finally:
        accelerate_launch.logger.disabled = False
    on_gpus = not launch.cpu
    if on_gpus and (launch.use_deepspeed or launch.use_fsdp or launch.use_megatron_lm or launch.multi_gpu):
        return True, not launch.use_deepspeed
    own_launcher = on_gpus and launch.tpu or getattr(defaults, "compute_environment", None) == ComputeEnvironment.AMAZON_SAGEMAKER
    return False, not own_launcher


def main():
    args = launch_command_parser().parse_args()
    if not (args.module or args.no_python or os.path.isfile(args.training_script)):  # os.path: False in a folder this user cannot enter
        fail(f"Training script {args.training_script} does not exist, or is in a folder you cannot read: pass the path of one of "
             "the files in scripts/.")
    # Without --config_file, accelerate launch reads the profile `accelerate config` saved, where there is one (not with --cpu).
    profile = args.config_file or (default_config_file if os.path.isfile(default_config_file) and not args.cpu else None)
    config = check_profile(profile, args.cpu) if profile else None
    template = template_launched(args)  # a script of your own may train in fp8
    fp8 = str(args.mixed_precision or getattr(config, "mixed_precision", None)).lower() == "fp8"  # accelerate lowercases a profile's
    if fp8 and not template and not is_fp8_available():  # else accelerate's traceback
        fail("Mixed precision fp8 (--mixed_precision, or the profile's) needs Transformer Engine, MS-AMP or torchao, which this "
             "Python lacks: install one, or pass bf16.")
    if fp8 and template:  # else a traceback, or a run the scripts refuse
        fail("Mixed precision fp8 (--mixed_precision, or the profile's) is not one the scripts train in: pass no, bf16, or fp16 on GPUs.")
    if template:
        check_script_flags(template, args.training_script_args)

    def setting(name):  # the command line's value, else the profile's
        value = getattr(args, name)
        return getattr(config, name, None) if value is None else value

    address = setting("main_process_ip")
    if (setting("num_machines") or 1) > 1 and address:  # found now, not after torchrun's retries to connect run out
        try:
            socket.getaddrinfo(address.strip("[]"), None)  # an IPv6 address may come in brackets
        except (socket.gaierror, UnicodeError) as error:  # UnicodeError: no host name at all (an empty or overlong label)
            if getattr(error, "errno", None) != socket.EAI_AGAIN:  # a resolver busy for now: torchrun tries again
                why = getattr(error, "strerror", None) or first_line(error)
                fail(f"--main_process_ip {address} is no address this machine can resolve ({why}): pass the address of machine 0 "
                     "that every machine reaches (the profile's MAIN_NODE_ADDRESS is a placeholder for it).")
    if args.cpu or (config and config.use_cpu):  # every process builds its Accelerator for the CPU, and so joins the gloo group
        os.environ["ACCELERATE_USE_CPU"] = "true"
    under_torchrun, runs_python_script = accelerates_launcher(args)
    if runs_python_script and not (args.module or args.no_python):
        # Each process starts through run_script.py: a Ctrl-C while it imports torch ends it in one line, not a traceback.
        args.training_script, args.training_script_args = str(HERE / "run_script.py"), [args.training_script, *args.training_script_args]
    if args.max_restarts:
        if not under_torchrun:
            fail("--max_restarts needs torchrun, which accelerate does not use for this launch (one process without a "
                 "multi-GPU profile, or --cpu): launch with --config_file accelerate_configs/cpu.yaml and no --cpu (on GPUs: "
                 "4gpu.yaml), adding --num_processes 1 for one process.")
        use_a_fresh_rendezvous_for_every_restart(args, setting)
    # torchrun logs every failure at length; the failed process has already said what went wrong.
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.propagate = False
    torchrun_log = TorchrunLog(setting("num_machines") or 1)
    elastic.addHandler(torchrun_log)
    agent_api.logger.setLevel(logging.INFO)  # its restart notice is an INFO record
    # The training processes' C++ warnings (gloo's connection notices, DDP's note on unused
    # parameters) too; errors still show. A value you set wins.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # SLURM's early warning (`--signal=USR1@120`) reaches every process of the job step, this launcher too:
    # torchrun (its --signals_to_handle) then shuts the run down, passing SIGUSR1 on, instead of dying of it
    # (SIGUSR1's default) or, with --max_restarts, restarting the processes that stopped after saving.
    args.signals_to_handle = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    # torchrun's wait between passing a signal on and killing: up to 10 steps and a checkpoint's save must
    # fit in it, and SLURM warns 120 s ahead. TORCH_ELASTIC_SHUTDOWN_TIMEOUT (torchrun's own) wins.
    shutdown_timeout = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "90")
    if not shutdown_timeout.strip().isdigit():
        fail(f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={shutdown_timeout} is not a whole number of seconds: set it to one, such as 90, or unset it.")
    args.shutdown_timeout = int(shutdown_timeout)
    accelerate_launch.simple_launcher = one_process_launcher  # launch_command looks it up when it runs
    # With --debug, and rich installed and ACCELERATE_ENABLE_RICH=1, accelerate prints torchrun's exception and swallows it:
    # a failed or stopped run would exit 0, which a cluster takes for finished. It reaches the handlers below instead.
    accelerate_launch.is_rich_available = lambda: False
    no_restart_after_a_mistake()
    remember_how_the_processes_ended()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if under_torchrun:  # whose rendezvous may wait long for the other machines
        torchrun_log.waiting = True
        stop_at_once_while_waiting(torchrun_log)
    try:
        launch_command(args)
    except ChildFailedError as error:
        rank, failure = cause_of_failure(error.failures, torchrun_log.stopped_by_torchrun)
        stopped(f"rank {rank} {how_it_ended(failure.exitcode)}", failure.exitcode)
    except subprocess.CalledProcessError as error:  # the one-process launcher
        stopped(f"the process {how_it_ended(error.returncode)}", error.returncode)
    except (ValueError, ConnectionError) as error:  # accelerate's checks of the launch arguments
        fail(f"{error} ")
    except RendezvousClosedError:  # under --max_restarts, another machine's launcher closed it as it left: no restart will meet it
        fail(f"Training stopped: another machine's launcher ended the run (its own output says why). {RESUME_IF_SAVED}")
    except (DistError, RendezvousError) as error:  # torchrun's rendezvous, where the machines meet
        at = f" at {address}:{setting('main_process_port')}" if address else ""
        if isinstance(error, RendezvousTimeoutError):  # under --max_restarts: machine 0 waited for the others, at the start or a restart
            fail(f"Training stopped: not every machine joined the rendezvous of the machines{at} within its join timeout: start every "
                 "machine with the same profile, each able to reach that address, and where one was lost mid-run (its own output, if "
                 "any, says why), resume with --resume_from_checkpoint latest on every machine if the run saved checkpoints.")
        if torchrun_log.started:  # under --max_restarts, machine 0's launcher, which hosts it, left as it ended the run
            fail(f"Training stopped: machine 0's launcher, which hosts the rendezvous of the machines{at}, ended the run (its own "
                 f"output says why) or can no longer be reached from here. {RESUME_IF_SAVED}")
        fail(f"The launch could not reach the rendezvous of the machines{at} ({first_line(error)}): machine 0 is not running, "
             "has stopped (its own output says why) or cannot be reached from here: start it with the same profile, and pass "
             "--main_process_ip its address that every machine reaches and a --main_process_port that is free there.")
    except SignalException as error:  # the processes were told to stop; with checkpoints they saved and said where
        if torchrun_log.waiting:
            end_while_waiting(error.sigval, torchrun_log.while_waiting())
        if torchrun_log.stopping_after_a_failure and A_RESTART_WAS_DUE == [True]:  # the failed one's exit 1 is no failed save
            end_while_waiting(error.sigval, "torchrun stopped the processes after one failed, to restart them")
        if set(EXIT_CODES_AT_SHUTDOWN) == {0}:  # the signal came after the last check: the run finished
            sys.exit(0)
        if 1 in EXIT_CODES_AT_SHUTDOWN:  # a save after the signal failed: no checkpoint to resume from, which 143 would promise
            sys.exit(1)
        died_of_it = EXIT_CODES_AT_SHUTDOWN and all(code == -error.sigval for code in EXIT_CODES_AT_SHUTDOWN)  # none saved
        if died_of_it and error.sigval != signal.SIGINT:  # Ctrl-C saves nothing by design, and says so where the processes get it
            # On a line of its own: a process that died of the signal may have left its progress bar's line open.
            print(f"\nStopped by {error.sigval.name}: the training processes ended at once, without saving a checkpoint (they save one only "
                  f"on SIGTERM or SIGUSR1, with --checkpointing_steps, once training has started). {RESUME_IF_SAVED}", file=sys.stderr, flush=True)
        # Killed (None: not reaped yet): by torchrun where its wait after passing the signal on ran out, else by something
        # else (the kernel's out-of-memory killer). 143 all the same, on which a cluster requeues: the newest checkpoint stays.
        if {-signal.SIGKILL, None} & set(EXIT_CODES_AT_SHUTDOWN) and SHUTDOWN_SECONDS[0] >= args.shutdown_timeout:
            print(f"error: Training stopped: the launcher killed the processes {args.shutdown_timeout} s after passing the signal on, before every "
                  "one had ended: the newest complete checkpoint, if any, stays 'latest'; for a longer save, raise TORCH_ELASTIC_SHUTDOWN_TIMEOUT.",
                  file=sys.stderr, flush=True)
        elif -signal.SIGKILL in EXIT_CODES_AT_SHUTDOWN:
            print("error: Training stopped: a training process was killed (SIGKILL: the kernel's out-of-memory killer, or a person) while the "
                  "processes stopped after the signal: the newest complete checkpoint, if any, stays 'latest'.", file=sys.stderr, flush=True)
        sys.exit(STOPPED_EXIT_CODE if error.sigval in (signal.SIGTERM, signal.SIGUSR1) else 128 + error.sigval)
    except KeyboardInterrupt:  # before the processes could say it (as they start), or where the launcher alone got it
        print("Stopped by Ctrl-C; resume with --resume_from_checkpoint latest if the run saved checkpoints.", file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
