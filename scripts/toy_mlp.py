"""Toy 2-feature MLP on 5 built-in training rows (tutorial 003), data-parallel through Hugging Face Accelerate.

The first rung of the templates: the Accelerate calls a data-parallel script needs, and nothing else.
The MNIST scripts add checkpoints, preemption, tracking, profiling and early stopping to the same loop.

Run on one process:           python scripts/toy_mlp.py
On 2 CPU processes (gloo):    python scripts/launch.py --config_file accelerate_configs/cpu.yaml --num_processes 2 scripts/toy_mlp.py
On 2 GPUs:                    accelerate launch --config_file accelerate_configs/2gpu.yaml scripts/toy_mlp.py
From a notebook:              notebook_launcher(in_notebook(main), args=([],), num_processes=2)  (shared/notebook.py)
"""

import argparse
import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import parse_flag_from_env, set_seed
from torch.utils.data import DataLoader, TensorDataset

from shared.errors import UserError, first_line, make_folders, run_main

X_TRAIN = torch.tensor([[-1.2, 3.1], [-0.9, 2.9], [-0.5, 2.6], [2.3, -1.1], [2.7, -1.5]])
Y_TRAIN = torch.tensor([0, 0, 0, 1, 1])
X_TEST = torch.tensor([[-0.8, 2.8], [2.6, -1.6]])
Y_TEST = torch.tensor([0, 1])


class NeuralNetwork(torch.nn.Module):
    """A multilayer perceptron with two hidden layers: num_inputs -> 30 -> 20 -> num_outputs."""

    def __init__(self, num_inputs=2, num_outputs=2):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(num_inputs, 30),
            torch.nn.ReLU(),
            torch.nn.Linear(30, 20),
            torch.nn.ReLU(),
            torch.nn.Linear(20, num_outputs),
        )

    def forward(self, x):
        return self.layers(x)


class OneLineParser(argparse.ArgumentParser):
    """A bad flag ends in one sentence that says what to do, not argparse's usage text."""

    def error(self, message):
        raise UserError(f"{message}: see {self.prog} --help for what it takes.", every_process=True)


def positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not 0 < value <= 3.4e38:  # not nan or inf, which would train a model of nan weights, nor past float32's range
            raise argparse.ArgumentTypeError(f"must be above 0 and at most 3.4e38, float32's largest, got {text}")
        return value
    return parse


def parse_args(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="runs/toy_mlp", help="where metrics.jsonl and model.safetensors go (default: %(default)s)")
    parser.add_argument("--num_epochs", type=positive(int), default=3, help="passes over the training rows (default: %(default)s)")
    # Batch 8: all 5 rows in one step, split over the 1, 2, 4 or 8 processes of every profile. Where 8 exceeds the rows,
    # accelerate tops the step up with rows from the epoch's start, one each: 2, 4 and 8 processes step on the same 8 rows.
    parser.add_argument("--batch_size", type=positive(int), default=8,
                        help="rows per optimizer step, split evenly across the processes: a multiple of the 5 rows (5, 10, "
                        "40) trains the same model at any number of processes it splits across; otherwise several "
                        "processes top the last step up with rows from the start (default: %(default)s)")
    parser.add_argument("--lr", type=positive(float), default=0.5, help="SGD's learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=123, help="seed for the weights and the shuffling (default: %(default)s)")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                        help="autocast precision (default: the launch profile's, else no)")
    args = parser.parse_args(argv)
    if not 0 <= args.seed < 2**32:  # set_seed seeds numpy too, which takes no other
        parser.error(f"argument --seed: must be from 0 to {2**32 - 1}, the seeds numpy takes, got {args.seed}")
    return args


@torch.no_grad()
def evaluate(model, loader, accelerator, prefix):
    """Every process must call this (it gathers): accuracy over all of loader's rows, each counted once."""
    model.eval()
    correct = total = 0
    for features, labels in loader:
        # Every process's predictions, less the rows the prepared loader repeated to even out the last batch.
        predictions, labels = accelerator.gather_for_metrics((model(features).argmax(dim=1), labels))
        correct += int((predictions == labels).sum())
        total += len(labels)
    model.train()
    return {f"{prefix}_accuracy": correct / total, f"{prefix}_samples": total}


def main(argv=None):
    args = parse_args(argv)
    asked = os.environ.get("CUDA_VISIBLE_DEVICES", "")  # a GPU profile's gpu_ids: never train on the CPU in their place
    if asked and not asked.startswith("-") and not torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU"):
        raise UserError(f"This launch asks for GPUs {asked} (a GPU profile) but PyTorch sees no GPU on this machine: launch with "
                        "--config_file accelerate_configs/cpu.yaml instead, or install a CUDA build of PyTorch.", every_process=True)
    # On a machine without GPUs, cpu=True puts a launch's processes into one gloo group (else each trains alone).
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision,
                              # The shuffle order depends only on the seed and the epoch, identically on every process.
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed))
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":  # accelerate would train in fp32, saying nothing
        raise UserError("Mixed precision fp16 runs only on a GPU: pass --mixed_precision bf16 (the CPU runs it) or no.", every_process=True)
    set_seed(args.seed)
    output_dir = Path(args.output_dir)
    # Found now, not after training (os.path: no PermissionError for a folder inside one this user cannot enter).
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UserError(f"--output_dir {output_dir} is a file, not a folder: choose another --output_dir.", every_process=True)
    if os.path.exists(output_dir / "metrics.jsonl") or os.path.exists(output_dir / "model.safetensors"):  # never write over earlier results
        raise UserError(f"--output_dir {output_dir} already holds a run: choose another --output_dir.", every_process=True)
    try:
        make_folders(output_dir)  # every process, before training; a failed run removes the folders it made
    except OSError as error:
        raise UserError(f"--output_dir {output_dir} could not be made ({first_line(error)}): choose another --output_dir.", every_process=True) from None
    if not os.access(output_dir, os.W_OK):
        raise UserError(f"--output_dir {output_dir} is a folder you cannot write in: choose another --output_dir.", every_process=True)
    # --batch_size rows per step, split across the processes: any world size takes the same steps on the same rows.
    if args.batch_size % accelerator.num_processes:
        raise UserError(f"--batch_size {args.batch_size} does not split evenly across {accelerator.num_processes} processes: "
                        f"pass a multiple of {accelerator.num_processes}.", every_process=True)
    train_set = TensorDataset(X_TRAIN, Y_TRAIN)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // accelerator.num_processes, shuffle=True)
    train_eval_loader = DataLoader(train_set, batch_size=2)
    test_loader = DataLoader(TensorDataset(X_TEST, Y_TEST), batch_size=2)

    model = NeuralNetwork(num_inputs=2, num_outputs=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    # prepare() puts the model on the device, wrapped in DDP, and shards each loader: every process gets its own rows, on that device.
    model, optimizer, train_loader, train_eval_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, train_eval_loader, test_loader)

    for epoch in range(1, args.num_epochs + 1):
        model.train()
        train_loader.set_epoch(epoch)  # the epoch's shuffle order, the same on every process
        loss_sum, rows = torch.zeros((), device=accelerator.device), 0
        for features, labels in train_loader:
            loss = F.cross_entropy(model(features).float(), labels)  # fp32 whatever the model computes in
            accelerator.backward(loss)  # gradients are averaged across processes here
            optimizer.step()
            optimizer.zero_grad()
            loss_sum += loss.detach() * len(labels)  # on the device: no sync per step
            rows += len(labels)
        # The mean loss over every process's rows: the processes' sums, added up.
        loss_sum, rows = accelerator.reduce(torch.stack([loss_sum, loss_sum.new_tensor(rows)]), reduction="sum").tolist()
        if not math.isfinite(loss_sum):  # the same sum on every process: all stop, before any model file is written
            raise UserError(f"Training diverged in epoch {epoch}: the loss is {loss_sum}. The learning rate is likely too high: "
                            "lower --lr and train again in a new --output_dir.", every_process=True)
        record = {"epoch": epoch, "train_loss": loss_sum / rows, **evaluate(model, train_eval_loader, accelerator, "train_eval"),
                  **evaluate(model, test_loader, accelerator, "eval"), "world_size": accelerator.num_processes,
                  "device": str(accelerator.device)}
        accelerator.print(f"epoch {epoch}/{args.num_epochs}  train_loss {record['train_loss']:.4f}  train accuracy "
                          f"{record['train_eval_accuracy']:.2f}  test accuracy {record['eval_accuracy']:.2f}  world_size {record['world_size']}")
        if accelerator.is_main_process:  # one process writes the record
            with open(output_dir / "metrics.jsonl", "a") as file:
                file.write(json.dumps(record) + "\n")

    accelerator.wait_for_everyone()
    # model.safetensors from the main process, unwrapped from DDP and torch.compile so that it loads into a plain NeuralNetwork.
    accelerator.save_model(accelerator.unwrap_model(model, keep_torch_compile=False), output_dir)
    accelerator.print(f"Saved the trained model to {output_dir / 'model.safetensors'}")
    accelerator.end_training()


if __name__ == "__main__":
    run_main(main)
