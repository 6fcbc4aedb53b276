"""slurm/train_2node.sbatch under a real Slurm: Debian's slurm-wlm with two nodes on this machine,
each slurmd in network, host-name and mount namespaces of its own (its address on a bridge, its
name, its spool folder and an /etc/hosts that names both nodes), slurmctld and munged beside them on
ports of their own. The batch script's srun starts one launcher per node; they meet at the first
node and train as one group. The job's early warning, as Slurm's `--signal=USR1@120` delivers it at
its time, saves a checkpoint at the step the run reached; the job requeues itself, starts again with
the same job id. A plain scancel then saves too; a new job pointed at the run (OUTPUT_DIR) goes on from
there, and ends bitwise where a run that was never stopped ends. Without Slurm, or where
namespaces are not permitted, the test skips and says why (.ci/run installs Slurm)."""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import uuid
from pathlib import Path

import pytest

from conftest import CONFIGS, PAUSE_PROBE, REPO, SCRIPTS, all_paused, launch_command, new_interpreter_env, paused_at, read_metrics, run
from synthetic_digits import write_small_mnist
from test_features import assert_same_records, assert_same_weights, weights

pytestmark = pytest.mark.xdist_group("slurm")  # one cluster for the module, on one test process

SLURM_CONF = """\
ClusterName=templates
SlurmctldHost={host}({controller})
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
AuthType=auth/munge
# A requeued job waits cred_expire + 1 s before it may start again (120 s by default).
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation={folder}/state
SlurmctldPidFile={folder}/slurmctld.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmctldDebug=debug  # the signals and kills asked of it, for a failure's message
# {folder}/node is each node's own folder, mounted there in its mount namespace.
SlurmdSpoolDir={folder}/node/spool
SlurmdPidFile={folder}/node/slurmd.pid
SlurmdLogFile={folder}/node/slurmd.log
SlurmdDebug=debug  # the signals each node is asked to deliver, for a failure's message
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
SUBNET = "10.214.0"  # the controller at .1 on the bridge, the nodes at .2 and .3 (tests/test_recovery.py's hosts use 10.213.0)


def munge_works():
    return subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0


def ip(*args, namespace=None, setting_up=True):
    """Run `ip`; a failure while setting up skips the tests with its reason."""
    done = subprocess.run([*(["ip", "netns", "exec", namespace] if namespace else []), "ip", *args], capture_output=True, text=True)
    if done.returncode and setting_up:
        pytest.skip(f"the nodes' network could not be made here (`ip {' '.join(args)}`: {done.stderr.strip()})")
    return done


def stop(process):
    """End a daemon's process group, started with start_new_session, and reap it."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def slurm():
    """A two-node Slurm on this machine: the environment its commands need (SLURM_CONF) and its folder."""
    missing = [tool for tool in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "ip", "nsenter", "unshare") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"needs Slurm, munge and util-linux ({', '.join(missing)} not found): apt-get install slurm-wlm munge")
    if ip("-4", "-o", "addr", "show", "to", f"{SUBNET}.0/24").stdout.strip():
        pytest.skip(f"{SUBNET}.0/24 is already in use on this machine")
    tag = uuid.uuid4().hex[:6]
    bridge, nodes = f"br{tag}", [(f"slurm{tag}{n}", f"node{n}", f"{SUBNET}.{n + 1}") for n in (1, 2)]  # namespace, name, address
    folder = Path(tempfile.mkdtemp(prefix="slurm-"))
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    started = []
    try:
        ip("link", "add", bridge, "type", "bridge")
        ip("addr", "add", f"{SUBNET}.1/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for namespace, _, address in nodes:  # a veth pair from the bridge into the node's namespace
            ip("netns", "add", namespace)
            ip("link", "add", f"v{namespace}", "type", "veth", "peer", "name", f"b{namespace}")
            ip("link", "set", f"b{namespace}", "master", bridge)
            ip("link", "set", f"b{namespace}", "up")
            ip("link", "set", f"v{namespace}", "netns", namespace)
            ip("addr", "add", f"{address}/24", "dev", f"v{namespace}", namespace=namespace)
            for device in (f"v{namespace}", "lo"):
                ip("link", "set", device, "up", namespace=namespace)
        host = socket.gethostname().split(".")[0]  # what `hostname -s` says, as slurmctld looks itself up
        (folder / "slurm.conf").write_text(SLURM_CONF.format(
            host=host, controller=f"{SUBNET}.1", folder=folder, nodes="\n".join(
                f"NodeName={name} NodeAddr={address} CPUs={os.cpu_count()} RealMemory=2000 State=UNKNOWN" for _, name, address in nodes)))
        (folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")  # no cgroups are used (proctrack/linuxproc)
        (folder / "hosts").write_text(f"127.0.0.1 localhost\n{SUBNET}.1 {host}\n" + "".join(f"{address} {name}\n" for _, name, address in nodes))
        for sub in ("state", "node", *(f"{name}/spool" for _, name, _ in nodes)):
            (folder / sub).mkdir(parents=True)
        if not munge_works():
            Path("/run/munge").mkdir(exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            started.append(subprocess.Popen(["runuser", "-u", "munge", "--", "munged", "-F"], start_new_session=True))
            deadline = time.monotonic() + 30  # munged answers before slurmctld, which needs it, starts
            while not munge_works() and time.monotonic() < deadline:
                time.sleep(0.2)
        started.append(subprocess.Popen(["slurmctld", "-D", "-f", folder / "slurm.conf"], env=env, start_new_session=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for namespace, name, _ in nodes:  # its jobs run in its namespaces too: its name, address and /etc/hosts
            node = (f"hostname {name} && mount --bind {folder / 'hosts'} /etc/hosts && mount --bind {folder / name} {folder / 'node'} "
                    f"&& exec slurmd -D -f {folder / 'slurm.conf'}")
            started.append(subprocess.Popen(["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--uts", "--mount",
                                             "--propagation", "private", "sh", "-c", node], env=env, start_new_session=True,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while subprocess.run(["sinfo", "-h", "-o", "%T %D"], env=env, capture_output=True, text=True).stdout.strip() != "idle 2":
            if time.monotonic() > deadline or any(process.poll() is not None for process in started):
                logs = "".join(log.read_text()[-1500:] for log in folder.rglob("*.log"))
                pytest.skip(f"Slurm did not start on this machine:\n{logs}")
            time.sleep(0.5)
        # The nodes reach the controller; whether they reach each other (a host whose firewall filters
        # bridged traffic would not let them), node 1 asks node 2's slurmd.
        reach = f"import socket; socket.create_connection(('{nodes[1][2]}', 16818), timeout=5)"
        if subprocess.run(["nsenter", f"--net=/run/netns/{nodes[0][0]}", sys.executable, "-c", reach], capture_output=True).returncode:
            pytest.skip("the nodes' namespaces cannot reach each other over the bridge here (bridged traffic filtered)")
        yield types.SimpleNamespace(env=env, folder=folder)
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True)
        deadline = time.monotonic() + 30  # the jobs' processes end before their daemons
        while subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        for process in reversed(started):
            stop(process)
        for namespace, _, _ in nodes:
            for pid in ip("netns", "pids", namespace, setting_up=False).stdout.split():  # a job step's processes, if any outlived it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            ip("netns", "del", namespace, setting_up=False)  # and the veth pair with it
        ip("link", "del", bridge, setting_up=False)
        shutil.rmtree(folder, ignore_errors=True)


def job_fields(job_id, env):
    """The job's fields, from scontrol, read at once (its state may move on between two reads)."""
    return dict(field.split("=", 1) for field in subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True, check=True).stdout.split() if "=" in field)


def what_slurm_logged(slurm, job_id, tmp_path):
    """For a failure's message: the tails of the job's output, the controller's log and each node's."""
    logs = [tmp_path / f"job-{job_id}.out", slurm.folder / "slurmctld.log", *(slurm.folder / node / "slurmd.log" for node in ("node1", "node2"))]
    return "\n".join(f"--- {log}\n{log.read_text()[-6000:] if log.exists() else '(none)'}" for log in logs)


def job_state(job_id, env):
    """The job's state and restart count."""
    fields = job_fields(job_id, env)
    return fields["JobState"], int(fields["Restarts"])


def submit(slurm, tmp_path, flags, env):
    """sbatch slurm/train_2node.sbatch on the two nodes, the script's flags after it; returns the job id."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", f"--cpus-per-task={os.cpu_count()}", "--gpus-per-node=0", f"--chdir={tmp_path}",
         f"--output={tmp_path}/job-%j.out", REPO / "slurm" / "train_2node.sbatch", *map(str, flags)],
        env=env, capture_output=True, text=True, check=True)
    return submitted.stdout.strip().split(";")[0]


def wait_for(condition, job_id, slurm, tmp_path, states, seconds):
    """Wait until condition() holds, while the job's state stays among `states`."""
    deadline = time.monotonic() + seconds
    while not condition():
        state = job_state(job_id, slurm.env)  # the condition may have come true since, and the job moved on
        assert condition() or (time.monotonic() < deadline and state[0] in states), (state, what_slurm_logged(slurm, job_id, tmp_path))
        time.sleep(0.2)


def test_slurm_early_warning_saves_at_the_step_reached_requeues_and_the_job_resumes_bitwise(slurm, tmp_path):
    """The job's processes wait for the signal after step 80, inside epoch 2 (tests/probes/pause_at_step.py
    around cpu_gloo.py), so that it reaches them before the run ends however busy the machine. The requeued
    job waits again after step 160, for a plain scancel: its SIGTERM reaches every process too (the first to reach
    one ends the pause of all, release_all, as the run needs no more: a CI run, 2026-11-28, had both processes still
    paused at Slurm's KillWait, with no record of which had had the signal), which save within KillWait, although
    srun, which Slurm signals too, asks to kill the job step at once (the controller drops it: REQUEST_CANCEL_JOB_STEP
    after the job's kill in its debug2 log, the job cancelled already); the job ends cancelled, and a new job with
    OUTPUT_DIR set to its run goes on."""
    write_small_mnist(tmp_path / "data", "MNIST", num_train=512, num_test=64)
    flags = ["--data_dir", tmp_path / "data", "--batch_size", "8", "--num_epochs", "6", "--log_interval", "1000"]
    # New interpreters, as the job's: Slurm signals the processes of the job step, which forks of the
    # tests' fork server would not be among.
    env = {**new_interpreter_env(), **slurm.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "CONFIG": str(CONFIGS / "cpu.yaml"), "GPUS_PER_NODE": "1", "SCRIPT": str(PAUSE_PROBE), **paused_at([80, 160], tmp_path, release_all=True),
           "LAUNCHER": str(SCRIPTS / "launch.py")}
    job_id = submit(slurm, tmp_path, flags, env)
    output_dir = tmp_path / "runs" / f"slurm-{job_id}"
    wait_for(lambda: all_paused(tmp_path, (0, 1), 80), job_id, slurm, tmp_path, ("PENDING", "RUNNING"), 180)
    # What `#SBATCH --signal=USR1@120` (no B:) does at its time: SIGUSR1 to every process of the job's
    # steps (here each node's launcher and its training process), not to the batch shell.
    subprocess.run(["scancel", "--signal=USR1", job_id], env=slurm.env, check=True)
    wait_for(lambda: all_paused(tmp_path, (0, 1), 160), job_id, slurm, tmp_path, ("RUNNING", "PENDING", "REQUEUED", "COMPLETING"), 240)
    assert job_state(job_id, slurm.env) == ("RUNNING", 1)
    subprocess.run(["scancel", job_id], env=slurm.env, check=True)  # SIGTERM to every process of the job, then SIGKILL after KillWait
    wait_for(lambda: job_state(job_id, slurm.env)[0] == "CANCELLED", job_id, slurm, tmp_path, ("RUNNING", "COMPLETING"), 60)

    log = (tmp_path / f"job-{job_id}.out").read_text()
    saved = [line.split("saved ")[1].split(" after")[0] for line in log.splitlines() if line.startswith("Stopped by a signal to stop: saved ")]
    assert [Path(checkpoint).name for checkpoint in saved] == ["step_00000080", "step_00000160"], (  # the steps reached
        {path.name: path.read_text() for path in tmp_path.glob("signalled_*")}, sorted(path.name for path in (output_dir / "checkpoints").glob("*")),
        what_slurm_logged(slurm, job_id, tmp_path))
    assert log.count("requeueing the job, which resumes from its newest checkpoint.") == 1, "after the warning, not the cancel"
    resumed = [line for line in log.splitlines() if line.startswith(f"Resumed from {saved[0]}: epoch ")]
    assert len(resumed) == 2, "said by the first process of each node, from the one checkpoint on the shared disk"
    assert int(resumed[0].split(", ")[1].split()[0]) > 0, "saved at the step reached, inside an epoch, not at an epoch's end"
    assert job_fields(job_id, slurm.env)["NodeList"] == "node[1-2]"
    for node in ("node1", "node2"):  # each node's slurmd started a task of the job's step: its launcher
        assert f"launch task StepId={job_id}.0 " in (slurm.folder / node / "slurmd.log").read_text(), node

    next_job = submit(slurm, tmp_path, flags, {**env, "OUTPUT_DIR": str(output_dir)})
    wait_for(lambda: job_state(next_job, slurm.env) == ("COMPLETED", 0), next_job, slurm, tmp_path, ("PENDING", "RUNNING", "COMPLETING"), 240)
    assert f"Resumed from {output_dir / 'checkpoints' / 'step_00000160'}: epoch 3, 32 batches in" in (tmp_path / f"job-{next_job}.out").read_text()

    reference = tmp_path / "never_stopped"
    run(launch_command("cpu_gloo.py", "--output_dir", reference, *flags, "--checkpointing_steps", "epoch", num_processes=2), cwd=tmp_path)
    assert {record["world_size"] for record in read_metrics(output_dir)} == {2}
    assert_same_weights(weights(reference), weights(output_dir))
    assert_same_records(read_metrics(reference), read_metrics(output_dir), rel=1e-6)


def made_ago(path, seconds):
    """Dates `path` `seconds` back, as the batch script reads what a job made before it, or an earlier start of it."""
    os.utime(path, (time.time() - seconds, time.time() - seconds))


def run_the_batch_script(tmp_path, srun):
    """slurm/train_2node.sbatch as job 7 with a stand-in srun (a shell script's body, ending in its exit code) and a
    stand-in scontrol that records a requeue; returns the result, the requeue recorded, if any, and the job's run.
    The stand-in `scontrol show hostnames` names the first node alone: the script reads no further line."""
    bin_dir, output_dir = tmp_path / "bin", tmp_path / "runs" / "slurm-7"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/sh\n{srun}\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\n[ \"$1\" = show ] && echo node0 && exit 0\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[0-1]",
           "SLURM_NNODES": "2", "OUTPUT_DIR": str(output_dir)}
    result = subprocess.run(["bash", REPO / "slurm" / "train_2node.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    requeued = (tmp_path / "scontrol.log").read_text() if (tmp_path / "scontrol.log").exists() else ""
    return result, requeued, output_dir


@pytest.mark.parametrize("model", ["the run's own end", "an earlier run's end"])
def test_the_batch_script_requeues_a_stopped_run_unless_it_saved_its_model(tmp_path, model):
    """The batch script's decision after srun, with a stand-in srun that returns 143 (what srun returns when the
    launchers stopped to save: the highest of their codes, per Slurm's documentation); the real Slurm test above
    cannot make a job stop after its model is saved. A model file saved during the job is its run's end: no
    requeue. One from before the job is the end of an earlier run that this job continues (OUTPUT_DIR of a
    finished job, a larger --num_epochs): the job requeues. Before, any model file ended such a job as finished,
    its epochs untrained."""
    output_dir = tmp_path / "runs" / "slurm-7"
    output_dir.mkdir(parents=True)
    (output_dir / "model.safetensors").write_bytes(b"weights")  # the earlier run's end, older than the job
    made_ago(output_dir / "model.safetensors", 60)
    saves = 'sleep 0.1; touch "$OUTPUT_DIR/model.safetensors"; ' if model == "the run's own end" else ""
    result, requeued, _ = run_the_batch_script(tmp_path, f"{saves}exit 143")
    if model == "the run's own end":
        assert result.returncode == 0 and requeued == "", (result.stdout, result.stderr)
    else:
        assert result.returncode == 143 and requeued == "requeue 7\n", (result.stdout, result.stderr)


@pytest.mark.parametrize("case", ["a checkpoint saved", "none saved", "none saved again", "none saved in another job",
                                  "none saved again, but some in a start between"])
def test_the_batch_script_requeues_a_run_stopped_twice_without_a_checkpoint_only_once(tmp_path, case):
    """srun returns 143 both when the launchers stopped to save and when one machine's processes crashed past
    --max_restarts and srun's --kill-on-bad-exit stopped the other's launcher with SIGTERM (seen once under the real
    Slurm above, 2026-11-27, with a probe whose rank 1 raised at every start and MAX_RESTARTS=1: "task 1: Exited with
    exit code 1", "task 0: Exited with exit code 143"; the job was requeued once, then ended in this sentence, failed).
    A job whose start saved a checkpoint is requeued; one that saved none is requeued once, and ends in a sentence
    the second time in a row: before, a run that crashes at every start was requeued forever. A start in between
    that saved checkpoints and ended otherwise (a node's failure, which Slurm requeues itself) makes it a first time."""
    checkpoints = tmp_path / "runs" / "slurm-7" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step_00000160").mkdir()
    made_ago(checkpoints / "step_00000160", 120)
    if case != "none saved":  # the job's start before saved none and was requeued (by the job whose id it holds)
        (checkpoints.parent / ".requeued_without_a_checkpoint").write_text("6\n" if case == "none saved in another job" else "7\n")
        made_ago(checkpoints.parent / ".requeued_without_a_checkpoint", 60)
    if case == "none saved again, but some in a start between":
        (checkpoints / "step_00000200").mkdir()
        made_ago(checkpoints / "step_00000200", 30)
    if case == "none saved again":  # a user's copy since is no checkpoint
        (checkpoints / "step_00000160.bak").mkdir()
    saves = 'sleep 0.1; mkdir "$OUTPUT_DIR/checkpoints/step_00000240"; ' if case == "a checkpoint saved" else ""
    result, requeued, output_dir = run_the_batch_script(tmp_path, f"{saves}exit 143")
    if case == "none saved again":
        assert result.returncode == 1 and requeued == "" and result.stderr.splitlines() == [
            "error: the training processes stopped without saving a checkpoint twice in a row: the job is not requeued again (a run "
            "that fails at every start would requeue forever; the lines above say why it stopped); once that is fixed, go on with "
            f"OUTPUT_DIR={output_dir} sbatch slurm/train_2node.sbatch (and the same arguments)."], (result.stdout, result.stderr)
    else:
        assert result.returncode == 143 and requeued == "requeue 7\n", (result.stdout, result.stderr)
        assert result.stdout.splitlines()[-1] == ("The training processes stopped on a signal (the lines above say whether they saved a "
                                                  "checkpoint); requeueing the job, which resumes from its newest checkpoint.")
        marker = output_dir / ".requeued_without_a_checkpoint"
        assert (not marker.exists()) if case == "a checkpoint saved" else marker.read_text() == "7\n"
