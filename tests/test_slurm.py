"""slurm/train_2node.sbatch under a real Slurm: Debian's slurm-wlm, one node on this machine (munged,
slurmctld and slurmd started here, in a folder of their own, on ports of their own). The job's early
warning, as Slurm's `--signal=USR1@120` delivers it at its time, saves a checkpoint at the step the
run reached; the job requeues itself, starts again with the same job id, and ends bitwise where a run
that was never stopped ends. Without Slurm the test skips and says how to get it (.ci/run installs it).

Two nodes need two machines: tests/test_features.py runs the batch script's two launches with a
stand-in for srun and scontrol instead."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import CONFIGS, REPO, SCRIPTS, launch_command, new_interpreter_env, read_metrics, run
from synthetic_digits import write_small_mnist
from test_features import assert_same_records, assert_same_weights, weights

pytestmark = pytest.mark.xdist_group("slurm")  # one cluster for the module, on one test process

SLURM_CONF = """\
ClusterName=templates
SlurmctldHost={host}(127.0.0.1)
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
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def munge_works():
    return subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def slurm():
    """A one-node Slurm on this machine; the environment its commands need (SLURM_CONF)."""
    missing = [tool for tool in ("munged", "slurmctld", "slurmd", "sbatch", "srun") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"needs Slurm and munge ({', '.join(missing)} not found): apt-get install slurm-wlm munge")
    folder = Path(tempfile.mkdtemp(prefix="slurm-"))
    host = socket.gethostname().split(".")[0]  # what `hostname -s` says, as slurmd looks itself up
    (folder / "slurm.conf").write_text(SLURM_CONF.format(host=host, folder=folder, cpus=os.cpu_count()))
    (folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")  # no cgroups are used (proctrack/linuxproc)
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    started = []
    if not munge_works():
        Path("/run/munge").mkdir(exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        started.append(subprocess.Popen(["runuser", "-u", "munge", "--", "munged", "-F"], start_new_session=True))
        time.sleep(1)
    for daemon in ("slurmctld", "slurmd"):
        started.append(subprocess.Popen([daemon, "-D", "-f", folder / "slurm.conf"], env=env, start_new_session=True,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1)
    deadline = time.monotonic() + 60
    while subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout.strip() != "idle":
        if time.monotonic() > deadline or any(process.poll() is not None for process in started):
            logs = "".join((folder / log).read_text()[-1500:] for log in ("slurmctld.log", "slurmd.log") if (folder / log).exists())
            for process in started:
                process.kill()
            pytest.skip(f"Slurm did not start on this machine:\n{logs}")
        time.sleep(0.5)
    yield env
    subprocess.run(["scancel", "--full", "--user", "root"], env=env)
    for process in reversed(started):
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    shutil.rmtree(folder, ignore_errors=True)


def job_state(job_id, env):
    """The job's state and restart count, from scontrol."""
    fields = dict(field.split("=", 1) for field in subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True, check=True).stdout.split() if "=" in field)
    return fields["JobState"], int(fields["Restarts"])


def test_slurm_early_warning_saves_at_the_step_reached_requeues_and_the_job_resumes_bitwise(slurm, tmp_path):
    write_small_mnist(tmp_path / "data", "MNIST", num_train=512, num_test=64)
    flags = ["--data_dir", tmp_path / "data", "--batch_size", "8", "--num_epochs", "6", "--log_interval", "1000"]
    # New interpreters, as the job's: Slurm signals the processes of the job step, which forks of the
    # tests' fork server would not be among.
    env = {**new_interpreter_env(), **slurm, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "CONFIG": str(CONFIGS / "cpu.yaml"), "GPUS_PER_NODE": "2", "SCRIPT": str(SCRIPTS / "cpu_gloo.py"),
           "LAUNCHER": str(SCRIPTS / "launch.py")}
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", f"--cpus-per-task={os.cpu_count()}", "--gpus-per-node=0", f"--chdir={tmp_path}",
         f"--output={tmp_path}/job-%j.out", REPO / "slurm" / "train_2node.sbatch", *map(str, flags)],
        env=env, capture_output=True, text=True, check=True)
    job_id = submitted.stdout.strip().split(";")[0]
    output_dir = tmp_path / "runs" / f"slurm-{job_id}"
    deadline = time.monotonic() + 180
    while not ((output_dir / "metrics.jsonl").exists() and read_metrics(output_dir)):
        assert time.monotonic() < deadline and job_state(job_id, slurm)[0] in ("PENDING", "RUNNING"), job_state(job_id, slurm)
        time.sleep(0.2)
    # What `#SBATCH --signal=USR1@120` (no B:) does at its time: SIGUSR1 to every process of the job's
    # steps (here the launcher and its training processes), not to the batch shell.
    subprocess.run(["scancel", "--signal=USR1", job_id], env=slurm, check=True)
    while (state := job_state(job_id, slurm)) != ("COMPLETED", 1):
        assert time.monotonic() < deadline + 120 and state[0] in ("RUNNING", "PENDING", "REQUEUED", "COMPLETING"), \
            (state, (tmp_path / f"job-{job_id}.out").read_text()[-3000:])
        time.sleep(0.5)

    log = (tmp_path / f"job-{job_id}.out").read_text()
    saved = [line for line in log.splitlines() if line.startswith("Stopped by a signal to stop: saved ")]
    assert len(saved) == 1, log[-3000:]
    checkpoint = saved[0].split("saved ")[1].split(" after")[0]
    assert "requeueing the job, which resumes from it" in log
    (resumed,) = [line for line in log.splitlines() if line.startswith(f"Resumed from {checkpoint}: epoch ")]
    assert int(resumed.split(", ")[1].split()[0]) > 0, "saved at the step reached, inside an epoch, not at an epoch's end"

    reference = tmp_path / "never_stopped"
    run(launch_command("cpu_gloo.py", "--output_dir", reference, *flags, "--checkpointing_steps", "epoch", num_processes=2), cwd=tmp_path)
    assert {record["world_size"] for record in read_metrics(output_dir)} == {2}
    assert_same_weights(weights(reference), weights(output_dir))
    assert_same_records(read_metrics(reference), read_metrics(output_dir), rel=1e-6)
