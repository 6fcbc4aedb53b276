"""mnist_conv on one GPU: the script's training samples/s against its step-rate ceiling, at the
tutorial's batch 64 and at a large batch with bf16, channels_last and torch.compile.

    python benchmarks/gpu_throughput.py                          # on a machine with a CUDA GPU
    python benchmarks/gpu_throughput.py --large_batch 15360 --train_samples 61440

On the same 53,760 random digits (7 x 7,680 and 840 x 64: both batch sizes divide it, so no epoch
ends in a ragged batch, which torch.compile would compile again with a dynamic batch size), each
setting runs twice, each time in a fresh process:
- script: `python scripts/mnist_conv.py` as a user runs it (the in-memory data path, which keeps the
  decoded set on the GPU), with --mixed_precision, --channels_last and, for torch.compile,
  ACCELERATE_DYNAMO_BACKEND=inductor (what `accelerate launch --dynamo_backend inductor` sets);
  its figure is the fastest of epochs 2..N of samples_per_sec in metrics.jsonl, which times the
  training steps alone, as the ceiling does (epoch 1 compiles and warms up);
- ceiling: the same model, optimizer and setting, Accelerate-prepared, stepping on batches already
  sliced on the GPU, with no loader, no evaluation and no bookkeeping (benchmarks/baselines.py), read
  the same way.
The results file names the device. Without a GPU it runs on the CPU, which only checks that the
command works: the targets are a GPU's.
"""

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402
from baselines import GpuSetting  # noqa: E402
import throughput  # noqa: E402
from throughput import run_script, write_data  # noqa: E402

LR = baselines.script_defaults("mnist_conv.py").lr  # the rate does not depend on it
SETTINGS = {  # name -> (large batch?, setting)
    "fp32": (False, GpuSetting()),
    "compiled": (False, GpuSetting(compile=True)),
    "large fp32": (True, GpuSetting()),
    "large bf16": (True, GpuSetting("bf16")),
    "large bf16 channels_last": (True, GpuSetting("bf16", channels_last=True)),
    "large bf16 channels_last compiled": (True, GpuSetting("bf16", channels_last=True, compile=True)),
}


def script_rate(setting, batch_size, data_dir, num_epochs, output_dir):
    command = ([baselines.PYTHON] + throughput.script_args("mnist_conv.py", data_dir, "memory", num_epochs, output_dir)
               + ["--batch_size", str(batch_size), "--mixed_precision", setting.mixed_precision]
               + (["--channels_last"] if setting.channels_last else []))
    records = run_script(command, {**os.environ, "ACCELERATE_DYNAMO_BACKEND": "inductor" if setting.compile else "no"}, output_dir)
    return max(r["samples_per_sec"] for r in records[1:])


def ceiling_rate(setting, batch_size, data_dir, num_epochs):
    rates = baselines.spawn(baselines.accelerate_ceiling, 1, None, "mnist_conv.py", str(data_dir), batch_size, num_epochs, LR, setting)
    return max(rates[1:])


def measure(names, batch_size, large_batch, num_epochs, train_samples, workdir):
    data_dir = Path(workdir) / "data"
    write_data(data_dir, train_samples)
    rows = []
    for name in names:
        large, setting = SETTINGS[name]
        batch = large_batch if large else batch_size
        script = script_rate(setting, batch, data_dir, num_epochs, Path(workdir) / name.replace(" ", "_"))
        ceiling = ceiling_rate(setting, batch, data_dir, num_epochs)
        rows.append({"setting": name, "batch_size": batch, **asdict(setting), "script": script, "ceiling": ceiling})
        print(f"measured {name}: script {script:,.0f}, ceiling {ceiling:,.0f} samples/s", file=sys.stderr, flush=True)
    return rows


def table(rows):
    lines = ["| setting | batch | mixed precision | channels_last | torch.compile | script samples/s | ceiling samples/s | script / ceiling |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['batch_size']} | {r['mixed_precision']} | {'yes' if r['channels_last'] else 'no'} | "
                     f"{'yes' if r['compile'] else 'no'} | {r['script']:,.0f} | {r['ceiling']:,.0f} | {r['script'] / r['ceiling']:.2f} |")
    return "\n".join(lines)


def targets(rows):
    """The issue's GPU targets, where this run measured what they need."""
    checks = []
    tutorial = [r for r in rows if r["setting"] == "fp32" and r["batch_size"] == 64]
    if tutorial:
        ratio = tutorial[0]["script"] / tutorial[0]["ceiling"]
        checks.append(f"{'PASS' if ratio >= 0.9 else 'MISS'}: batch 64, the tutorial's settings: script >= 0.9 x step ceiling ({ratio:.3f})")
    large = [r for r in rows if SETTINGS[r["setting"]][0]]
    if large:
        best = max(large, key=lambda r: r["script"])
        checks.append(f"{'PASS' if best['script'] >= 500_000 else 'MISS'}: large batch: script >= 500,000 samples/s on an H100 "
                      f"({best['script']:,.0f} with {best['setting']}, batch {best['batch_size']})")
    return "\n".join(f"- {line}" for line in checks)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), metavar="SETTING",
                        help=f"which to run, of: {', '.join(repr(name) for name in SETTINGS)}")
    parser.add_argument("--batch_size", type=int, default=64, help="the batch of the settings not called large (the tutorial's)")
    parser.add_argument("--large_batch", type=int, default=7680, help="the batch of the large settings")
    parser.add_argument("--num_epochs", type=int, default=5, help="epoch 1 compiles and warms up; the fastest of the rest is reported")
    parser.add_argument("--train_samples", type=int, default=53760, help="a multiple of both batch sizes")
    parser.add_argument("--output", default="benchmarks/gpu_throughput.json", help="the rows as JSON")
    args = parser.parse_args()
    if args.num_epochs < 2:
        parser.error("--num_epochs must be 2 or more: epoch 1 compiles and warms up, and is not reported")
    for batch in {args.batch_size, args.large_batch}:
        if args.train_samples % batch:
            parser.error(f"--train_samples {args.train_samples} is not a multiple of the batch {batch}: the last batch would be ragged")
    started = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        rows = measure(args.settings, args.batch_size, args.large_batch, args.num_epochs, args.train_samples, workdir)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"no GPU: {platform.machine()} CPU, a check of the command only"
    Path(args.output).write_text(json.dumps({"device": device, **baselines.measured_with(), "train_samples": args.train_samples, "rows": rows},
                                            indent=1))
    print(f"Device: {device}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; {args.train_samples:,} training samples; "
          f"{time.time() - started:.0f} s.\n")
    print(table(rows))
    if torch.cuda.is_available():
        print("\nTargets:\n" + targets(rows))


if __name__ == "__main__":
    main()
