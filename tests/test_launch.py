"""The launch profiles: they load, they say what their names claim, and cpu.yaml really makes one group."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file

from conftest import CONFIGS, REPO, SCRIPTS, launch_command, new_interpreter_env, read_metrics, run, script_env
from test_scripts import load_script_module

PROBE = Path(__file__).resolve().parent / "probes" / "shard_probe.py"

# profile -> (distributed type, processes, machines, uses the CPU, mixed precision)
PROFILES = {
    "cpu.yaml": ("MULTI_GPU", 4, 1, True, "no"),
    "1gpu.yaml": ("NO", 1, 1, False, "no"),
    "2gpu.yaml": ("MULTI_GPU", 2, 1, False, "no"),
    "4gpu.yaml": ("MULTI_GPU", 4, 1, False, "no"),
    "4gpu_bf16.yaml": ("MULTI_GPU", 4, 1, False, "bf16"),
    "8gpu.yaml": ("MULTI_GPU", 8, 1, False, "no"),
    "2node_4gpu.yaml": ("MULTI_GPU", 8, 2, False, "no"),
    "fsdp.yaml": ("FSDP", 4, 1, False, "bf16"),
}


def test_every_profile_is_listed_here():
    assert {path.name for path in CONFIGS.glob("*.yaml")} == set(PROFILES)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_loads_and_says_what_its_name_claims(name):
    path = CONFIGS / name
    config = load_config_from_file(str(path))
    distributed_type, processes, machines, on_cpu, precision = PROFILES[name]
    assert config.distributed_type.value == distributed_type
    assert (config.num_processes, config.num_machines, config.use_cpu) == (processes, machines, on_cpu)
    assert config.mixed_precision == precision
    assert path.read_text().startswith("#"), "each profile opens with a comment saying what it is for"
    if machines > 1:  # the GPUs a scheduler gave the job, as CUDA_VISIBLE_DEVICES has them
        assert config.gpu_ids == "all"
    elif not on_cpu:  # GPU profiles on one machine name one GPU per process
        assert len(config.gpu_ids.split(",")) == processes


def test_every_script_with_its_defaults_splits_its_batch_under_every_profile():
    """Each profile's process count (1, 2, 4, 8) divides each script's default --batch_size, so the same
    defaults train the same model under every profile."""
    from shared.flags import batch_size_per_process

    counts = {load_config_from_file(str(CONFIGS / name)).num_processes for name in PROFILES}
    assert counts == {1, 2, 4, 8}
    for script in ("seq_net.py", "mnist_conv.py", "cpu_gloo.py", "toy_mlp.py"):
        defaults = load_script_module(SCRIPTS / script).parse_args([])
        for count in counts:
            split = getattr(defaults, "split_batches", True)  # toy_mlp.py always splits
            assert batch_size_per_process(defaults.batch_size, count, split=split) * count == defaults.batch_size


def test_toy_mlp_with_its_defaults_trains_as_eight_processes(tmp_path):
    """The 8 processes of 8gpu.yaml and 2node_4gpu.yaml, here on the CPU: more processes than toy_mlp has
    rows, each given one by accelerate's top-up of the epoch's last step."""
    run(launch_command("toy_mlp.py", "--output_dir", tmp_path / "run", num_processes=8), cwd=tmp_path)
    records = read_metrics(tmp_path / "run")
    assert {record["world_size"] for record in records} == {8} and records[-1]["train_eval_accuracy"] == 1.0


def test_fsdp_profile_shards_with_fsdp2():
    config = load_config_from_file(str(CONFIGS / "fsdp.yaml")).fsdp_config
    assert config["fsdp_version"] == 2 and config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"


def test_two_node_profile_has_placeholders_to_fill():
    text = (CONFIGS / "2node_4gpu.yaml").read_text()
    assert "MAIN_NODE_ADDRESS" in text and re.search(r"machine_rank: 0 +# PLACEHOLDER", text)


def launch_probe(tmp_path, *launch_flags, num_samples=96, batch_size=4):
    """Each process's report of what it drew through both data pipelines."""
    command = [sys.executable, "-m", "accelerate.commands.launch", *launch_flags, PROBE, tmp_path, num_samples, batch_size]
    run(command, cwd=tmp_path)
    return [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]


def test_cpu_profile_starts_one_gloo_group_with_disjoint_covering_shards(tmp_path):
    """The profile as it is (4 processes), both data pipelines: over one epoch each sample is drawn
    exactly once across the ranks, the order changes between epochs, and every rank agrees on it.
    (--num_processes overriding the profile: the ragged-end test below, and most launches in tests.)"""
    reports = launch_probe(tmp_path, "--config_file", CONFIGS / "cpu.yaml")
    world_size = 4
    assert [r["rank"] for r in reports] == list(range(world_size))
    for report in reports:
        assert report["world_size"] == report["group_size"] == world_size
        assert report["backend"] == "gloo"
    for pipeline in ("torchvision", "memory"):
        for epoch in ("1", "2"):
            shards = [sum(r["epochs"][pipeline][epoch], []) for r in reports]
            drawn = sum(shards, [])
            assert sorted(drawn) == list(range(96)), f"{pipeline}: disjoint, and together the whole training set"
            assert all(len(shard) == 96 // world_size for shard in shards)
        assert reports[0]["epochs"][pipeline]["1"] != reports[0]["epochs"][pipeline]["2"], "reshuffled every epoch"
        assert len({json.dumps(r["all_first_batches"][pipeline]) for r in reports}) == 1


def test_both_pipelines_shard_identically_with_a_ragged_end(tmp_path):
    """100 samples over 3 processes in batches of 8: the in-memory loader tops up the last batches
    from the start of the epoch's order exactly as accelerate's prepared DataLoader does."""
    reports = launch_probe(tmp_path, "--config_file", CONFIGS / "cpu.yaml", "--num_processes", "3", num_samples=100, batch_size=8)
    assert [(r["rank"], r["group_size"]) for r in reports] == [(0, 3), (1, 3), (2, 3)]  # --num_processes 3 overrides the profile's 4
    by_pipeline = {pipeline: [r["epochs"][pipeline] for r in reports] for pipeline in ("memory", "torchvision")}
    assert by_pipeline["memory"] == by_pipeline["torchvision"]
    drawn = sorted(sum((sum(epochs["1"], []) for epochs in by_pipeline["memory"]), []))
    assert len(drawn) == 3 * 5 * 8 and set(drawn) == set(range(100))  # 20 samples drawn twice


@pytest.mark.parametrize("script", ["seq_net.py", "toy_mlp.py"])
def test_gpu_profile_on_a_machine_without_gpus_stops_with_a_clear_sentence(script, tmp_path):
    """Under plain accelerate launch, the complete scripts' devices.cpu_only() catches it in every
    process, and the first rung's own check of the profile's gpu_ids; before, toy_mlp.py trained on the CPU."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIGS / "2gpu.yaml",
        "--main_process_port", "0", REPO / "scripts" / script, "--output_dir", tmp_path / "run",
    ]
    # A new interpreter: torchrun reads LOGLEVEL as it is imported (by the fork server already), to name the ranks it starts.
    result = run(command, cwd=tmp_path, check=False, env={**new_interpreter_env(), "LOGLEVEL": "INFO"}, new_interpreter=True)
    assert "global_ranks=[0, 1]" in result.stderr, "torchrun starts the profile's 2 processes"
    assert result.returncode != 0
    assert "asks for GPUs 0,1 (a GPU profile) but PyTorch sees no GPU" in result.stderr
    assert not (tmp_path / "run").exists()
    assert result.stderr.count("error: ") == 1, "said once on this machine, not once per process"


def test_the_cpu_profile_trains_where_the_environment_names_gpus(tmp_path):
    """A job's environment may name GPUs (a cluster sets CUDA_VISIBLE_DEVICES for a node's allocation)
    that a cpu.yaml launch does not use: the first rung trains on the CPU as one group, not refused."""
    result = run(launch_command("toy_mlp.py", "--output_dir", tmp_path / "run", num_processes=2), cwd=tmp_path,
                 env=script_env() | {"CUDA_VISIBLE_DEVICES": "0"})
    assert "error" not in result.stderr and {record["world_size"] for record in read_metrics(tmp_path / "run")} == {2}


def test_more_processes_on_a_machine_than_its_gpus_stop_every_process_with_one_sentence(monkeypatch):
    """A stand-in for a one-GPU machine, which this one is not: it assumes that torch reports one device
    and that torchrun tells each of 4gpu.yaml's processes LOCAL_WORLD_SIZE 4; on the real machine three of
    them would fail in CUDA with "invalid device ordinal", a traceback each."""
    from shared import devices
    from shared.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(UserError, match=r"^This launch asks for GPUs 0,1,2,3 \(a GPU profile\), one for each of its 4 processes on this "
                       r"machine, but PyTorch sees 1: pass --num_processes 1, or train on the CPU with scripts/launch.py --config_file "
                       r"accelerate_configs/cpu.yaml\.$") as stop:
        devices.cpu_only()
    assert stop.value.every_process, "every process stops with it, so each machine says it once"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # gpu_ids all (2node_4gpu.yaml): the GPUs are counted all the same
    monkeypatch.setenv("WORLD_SIZE", "8")  # accelerate's --num_processes counts the processes of every machine
    with pytest.raises(UserError, match=r"asks for GPUs all, one for each of its 4 processes on this machine, but PyTorch sees 1: "
                       r"pass --num_processes 2 \(1 on each of 2 machines\)"):
        devices.cpu_only()
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # cpu.yaml's processes leave the GPUs alone, those a job names too
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert devices.cpu_only() is True
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "false")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # --num_processes 1, as the sentence advises
    assert devices.cpu_only() is False


def test_accelerates_debug_with_rich_still_ends_a_failed_run_in_a_failure(tmp_path):
    """accelerate's --debug, where rich is installed and ACCELERATE_ENABLE_RICH=1, printed torchrun's exception through rich
    and swallowed it: the launcher exited 0 after a failed run. A stand-in rich (its package metadata, and a console
    that prints nothing) makes accelerate take that path; the test is of what the launcher does with it."""
    site = tmp_path / "site"
    (site / "rich").mkdir(parents=True)
    (site / "rich" / "__init__.py").write_text("class Console:\n    def print(self, *args, **kwargs):\n        pass\n\n"
                                             "    print_exception = print\n\n\ndef get_console():\n    return Console()\n")
    (site / "rich" / "logging.py").write_text("import logging\nRichHandler = logging.StreamHandler\n")
    (site / "rich" / "traceback.py").write_text("def install(**kwargs):\n    pass\n")
    (site / "rich-13.0.0.dist-info").mkdir()
    (site / "rich-13.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: rich\nVersion: 13.0.0\n")
    (tmp_path / "fails.py").write_text("import sys\nsys.exit(3)\n")
    command = [sys.executable, SCRIPTS / "launch.py", "--config_file", CONFIGS / "cpu.yaml", "--num_processes", "2", "--debug", tmp_path / "fails.py"]
    env = {**script_env(), "PYTHONPATH": f"{site}:{REPO}", "ACCELERATE_ENABLE_RICH": "1"}
    result = run(command, cwd=tmp_path, env=env, check=False, new_interpreter=True)
    assert result.returncode == 1 and re.search(r"rank [01] exited with code 3", result.stderr), result.stderr[-3000:]
