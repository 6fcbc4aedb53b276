"""The flags every complete script shares, named as accelerate's examples name them, and their
one-sentence checks. Each script declares its own epochs, batch size, learning rate and schedule."""

import argparse
import os

from shared.errors import UserError

BATCH_SIZE_HELP = ("training samples per optimizer step, split evenly across the processes, so that any number of "
                   "processes takes the same steps on the same samples and trains the same model (with --no_split_batches: per process)")
# What a complete template's user lowers when memory runs out, which run_main and the checks of writes and loads give.
OUT_OF_MEMORY_ADVICE = ("halve --batch_size and double --gradient_accumulation_steps (a step's samples stay the same), or lower "
                        "--eval_batch_size if evaluation ran out, then resume with --resume_from_checkpoint latest if the run saved checkpoints")
KEEP_UNDER_RESTARTS = 2  # the newest to resume from, and one before it in case the newest is damaged


def _number(kind, what, accepts, rule):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value
    return parse


positive_int = _number(int, "a whole number", lambda value: value >= 1, "at least 1")
non_negative_int = _number(int, "a whole number", lambda value: value >= 0, "0 or more")
positive_float = _number(float, "a number", lambda value: value > 0, "greater than 0")
accuracy = _number(float, "a number", lambda value: 0 < value <= 1, "an accuracy above 0 and at most 1")
learning_rate = _number(float, "a number", lambda value: 0 < value <= 3.4e38, "above 0 and at most 3.4e38, float32's largest")
megabytes = _number(float, "a number", lambda value: 0 < value <= 2**20, "above 0 and at most a terabyte (1048576)")
seed = _number(int, "a whole number", lambda value: 0 <= value < 2**32, f"from 0 to {2**32 - 1}, the seeds numpy takes")
# torch's deadlines overflow past about 9e9 s: its rendezvous then times out at once, which would read as a lost peer.
timeout_seconds = _number(int, "a whole number", lambda value: 1 <= value <= 10**9, "from 1 to 1000000000 (about 31 years)")
every_n_steps = _number(int, "'epoch' or a whole number of steps", lambda value: value >= 1, "at least 1")


def checkpointing_steps(text):
    """'epoch', or a whole number of optimizer steps."""
    return text if text == "epoch" else every_n_steps(text)


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad flag, or a flag that would do nothing, in one line that says what to do."""

    def error(self, message):
        raise UserError(f"{message}: see {self.prog} --help for what it takes.", every_process=True)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        for flag, needs, given in (("report_to", "--with_tracking", lambda: namespace.with_tracking),
                                   ("keep_last_checkpoints", "--checkpointing_steps", lambda: namespace.checkpointing_steps),
                                   ("dataset_name", "--dataset_source hub", lambda: namespace.dataset_source == "hub")):
            if getattr(namespace, flag, None) != self.get_default(flag) and not given():
                self.error(f"argument --{flag} does nothing without {needs}")
        for flag in ("profile", "with_tracking"):  # they record training steps, and would write nothing
            if getattr(namespace, "eval_only", False) and getattr(namespace, flag, False):
                self.error(f"argument --{flag} does nothing with --eval_only, which trains no step")
        return namespace, extras


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's example lines as written, and shows every default that says something."""

    def _get_help_string(self, action):  # not a switch's True or False, an unset flag's None, or a default the help names
        if action.nargs == 0 or action.default is None or "default" in action.help:
            return action.help
        return super()._get_help_string(action)


def training_parser(description, *, output_dir, hub_name):
    """A parser with the flags every complete script shares (`hub_name`: --dataset_name's default); the script adds its own."""
    parser = OneLineParser(description=description, formatter_class=HelpFormatter)
    add = parser.add_argument_group("flags every complete template shares").add_argument  # --help lists the script's own first
    add("--output_dir", default=output_dir, help="where metrics.jsonl, model.safetensors and checkpoints go")
    add("--seed", type=seed, default=42, help="seed for weights, shuffling and every random generator")
    add("--max_train_steps", type=positive_int, default=None,
        help="stop after this many optimizer steps, mid-epoch too, then evaluate and save the model (overrides --num_epochs)")
    add("--no_split_batches", dest="split_batches", action="store_false",
        help="give every process a batch of --batch_size, as the tutorials do: N processes then step on N x "
        "--batch_size samples and take N times fewer steps per epoch")
    add("--mixed_precision", choices=["no", "fp16", "bf16"], default=None, help="autocast precision; default: the launch profile's, else no")
    add("--gradient_accumulation_steps", type=positive_int, default=1, help="batches whose gradients are summed before each optimizer step")
    add("--overwrite_output_dir", action="store_true", help="start a new run in an output_dir that already holds one (its files are replaced)")
    add("--checkpointing_steps", type=checkpointing_steps, default=None,
        help="save the full training state every N optimizer steps, or after every 'epoch'; a signal to stop then saves one too")
    add("--resume_from_checkpoint", default=None, metavar="PATH|latest",
        help="continue from a checkpoint folder, or the newest under <output_dir>/checkpoints")
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0  # a launcher that restarts would otherwise pile them up
    add("--keep_last_checkpoints", type=positive_int, default=KEEP_UNDER_RESTARTS if restarts else None,
        help=f"delete all but the newest K checkpoints (under --max_restarts the default is {KEEP_UNDER_RESTARTS})")
    add("--eval_only", action="store_true", help="only evaluate the weights of --resume_from_checkpoint (a checkpoint folder or a model.safetensors)")
    add("--ddp_timeout", type=timeout_seconds, default=1800,
        help="seconds a process waits for the others at a collective before it fails: how soon a run stops "
        "when another machine or the network to it is lost (the main process's download is waited for too)")
    add("--early_stopping_patience", type=positive_int, default=None,
        help="stop when eval loss has not improved for this many epochs (a resumed run remembers its count)")
    add("--early_stopping_target", type=accuracy, default=None, metavar="ACC",
        help="stop after the first epoch whose eval accuracy reaches ACC (between 0 and 1), as time-to-accuracy benchmarks do")
    add("--ddp_comm_hook", choices=["no", "fp16", "bf16", "power_sgd"], default="no",
        help="compress DDP's gradient all-reduce: fp16/bf16 halve its bytes, PowerSGD sends a low-rank approximation "
        "(see benchmarks/README.md for what each buys and costs)")
    add("--ddp_bucket_cap_mb", type=megabytes, default=None,
        help="DDP's gradient bucket size in MB (torch's default: 25): smaller buckets start their all-reduce earlier in backward")
    add("--profile", action="store_true",
        help="record a window of training steps with torch.profiler: a trace per process under <output_dir>/profile/")
    add("--with_tracking", action="store_true", help="log hyperparameters and epoch metrics to --report_to")
    add("--report_to", choices=["tensorboard", "mlflow", "all"], default=None,
        help="tracker for --with_tracking, stored under --output_dir (default: tensorboard)")
    add("--data_dir", default="./data", help="where data sets are cached (downloaded once per machine)")
    add("--num_workers", type=non_negative_int, default=0, help="DataLoader worker processes per training process")
    add("--dataset_source", choices=["torchvision", "hub"], default="torchvision",
        help="torchvision's download, or the Hugging Face Hub through the datasets library")
    add("--dataset_name", default=hub_name, help="with --dataset_source hub: a Hub data set, or a local folder of one")
    add("--data_pipeline", choices=["memory", "torchvision"], default="memory",
        help="memory: decode once, slice batches from tensors on the device; torchvision: the tutorials' "
        "per-sample DataLoader, for data that does not fit in memory")
    return parser


def batch_size_per_process(batch_size, num_processes, split):
    """Each process's training batch: --batch_size split evenly across the processes, or all of it with
    --no_split_batches. (accelerate's split_batches=True splits every prepared loader, the evaluation
    batch of 1,000 too, which 3 processes cannot split, and does not reach the in-memory loader.)"""
    if not split:
        return batch_size
    if batch_size % num_processes:
        raise UserError(
            f"--batch_size {batch_size} does not split evenly across {num_processes} processes: pass a multiple of "
            f"{num_processes}, or --no_split_batches to give every process a batch of {batch_size}.", every_process=True)
    return batch_size // num_processes


def check_precision(accelerator):
    """Stop when fp16 would run on the CPU: accelerate then trains in fp32, without autocast and without a
    word, and every record would say fp16."""
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise UserError("Mixed precision fp16 (--mixed_precision, or the launch profile's) runs only on a GPU; on the CPU accelerate "
                        "would train in fp32 all the same: pass --mixed_precision bf16, which the CPU runs, or no.", every_process=True)


def check_batch_fits(batch_size, num_samples, split):
    """Stop when --batch_size (split across the processes) is more than the training set: with several processes
    the prepared loader repeats samples to fill a step, a different share at each number of processes."""
    if split and batch_size > num_samples:
        raise UserError(f"--batch_size {batch_size} is more than the {num_samples} samples of the training set: pass at most "
                        f"{num_samples}, so that every number of processes takes the same steps.", every_process=True)


def check_accumulation(accumulation_steps, batches_per_epoch):
    """Stop when one accumulation window would be longer than an epoch: accelerate ends the window at
    the epoch's end and divides by the whole window, so every epoch would take one small step."""
    if accumulation_steps > batches_per_epoch:
        # accelerate takes it from this variable, where set, over the flag
        given = ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS=" if "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" in os.environ
                 else "--gradient_accumulation_steps ")
        raise UserError(
            f"{given}{accumulation_steps} is more than the {batches_per_epoch} batches each process trains in an epoch, so every "
            f"epoch would take one small optimizer step: give at most {batches_per_epoch}, or a smaller --batch_size.", every_process=True)
