"""What a short run costs a new process, in CPU seconds (user + system), against the imports it cannot avoid.

    python benchmarks/startup.py --rounds 5

Each round runs, each in a new interpreter and in rotating order:
- `import torch, accelerate`: what every Accelerate script pays;
- the same and `torch._dynamo`: what any script with a torch optimizer pays, since torch.optim's
  Optimizer imports torch._dynamo when it is built (torch._disable_dynamo in torch/_compile.py);
- `python scripts/cpu_gloo.py --help`;
- `python scripts/cpu_gloo.py --max_train_steps 5` and `--num_epochs 1` on 2,000 small digits.
It prints the median and range of each, and each one's median over the first's.
"""

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tools"), str(REPO / "benchmarks")]
from baselines import rotated, spread  # noqa: E402
from synthetic_digits import write_small_mnist  # noqa: E402


def cpu_seconds(command, env):
    """The CPU seconds a command's process and its children spent."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, env=env, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HOME": str(Path.home())}
    with tempfile.TemporaryDirectory() as workdir:
        data = Path(workdir) / "data"
        write_small_mnist(data, "MNIST", num_train=2000, num_test=200)
        script = [sys.executable, str(REPO / "scripts" / "cpu_gloo.py")]
        commands = {
            "import torch, accelerate": [sys.executable, "-c", "import torch, accelerate"],
            "+ import torch._dynamo": [sys.executable, "-c", "import torch, accelerate, torch._dynamo"],
            "cpu_gloo.py --help": [*script, "--help"],
            "cpu_gloo.py --max_train_steps 5": [*script, "--data_dir", str(data), "--max_train_steps", "5", "--overwrite_output_dir"],
            "cpu_gloo.py --num_epochs 1": [*script, "--data_dir", str(data), "--num_epochs", "1", "--overwrite_output_dir"],
        }
        times = {name: [] for name in commands}
        names = list(commands)
        for round_index in range(args.rounds):
            for name in rotated(names, round_index):
                command = commands[name]
                if "--data_dir" in command:
                    command = [*command, "--output_dir", str(Path(workdir) / "run")]
                times[name].append(cpu_seconds(command, env))
    first = statistics.median(times[names[0]])
    print(f"CPU seconds per new process, median (range) of {args.rounds} rounds\n")
    print("| command | CPU s | over `import torch, accelerate` |\n|---|---|---|")
    for name in names:
        print(f"| {name} | {spread(times[name], 2)} | {statistics.median(times[name]) / first:.2f}x |")


if __name__ == "__main__":
    main()
