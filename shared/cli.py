"""The command-line flags every script shares, named as accelerate's own examples name them."""

import argparse

from shared.runtime import UserError


def positive_int(text):
    value = _parse(int, text, "a whole number")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def positive_float(text):
    value = _parse(float, text, "a number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


def non_negative_int(text):
    value = _parse(int, text, "a whole number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def accuracy(text):
    value = _parse(float, text, "a number")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be an accuracy above 0 and at most 1, got {text}")
    return value


def checkpointing_steps(text):
    """'epoch', or a whole number of optimizer steps."""
    return text if text == "epoch" else positive_int(text)


def _parse(kind, text, what):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad flag, or a flag that would do nothing, in one line that says what to do."""

    def error(self, message):
        raise UserError(f"{message}: see {self.prog} --help for what it takes.")

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        for flag, needs in (("report_to", "with_tracking"), ("keep_last_checkpoints", "checkpointing_steps")):
            if getattr(namespace, flag, None) is not None and not getattr(namespace, needs, None):
                self.error(f"argument --{flag} does nothing without --{needs}")
        return namespace, extras


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's example lines as written, and shows every default."""


def training_parser(description, *, name, num_epochs, batch_size, lr, eval_batch_size, seed=42, gamma=1.0):
    """A parser with the shared flags; each script passes the defaults of the tutorial it mirrors."""
    parser = OneLineParser(description=description, formatter_class=HelpFormatter)
    parser.add_argument("--output_dir", default=f"runs/{name}", help="where metrics.jsonl, model.safetensors and checkpoints go")
    parser.add_argument("--num_epochs", type=positive_int, default=num_epochs, help="passes over the training set")
    parser.add_argument(
        "--max_train_steps", type=positive_int, default=None,
        help="stop after this many optimizer steps, mid-epoch too, then evaluate and save the model (overrides --num_epochs)",
    )
    parser.add_argument(
        "--batch_size", type=positive_int, default=batch_size,
        help="training samples per step, split evenly across the processes, so that any number of processes takes "
        "the same steps on the same samples and trains the same model (with --no_split_batches: per process)",
    )
    parser.add_argument(
        "--no_split_batches", dest="split_batches", action="store_false",
        help="give every process a batch of --batch_size, as the tutorials do: N processes then step on N x "
        "--batch_size samples and take N times fewer steps per epoch",
    )
    parser.add_argument("--eval_batch_size", type=positive_int, default=eval_batch_size, help="evaluation batch size per process")
    parser.add_argument("--lr", type=positive_float, default=lr, help="learning rate (the same at every world size)")
    parser.add_argument("--gamma", type=positive_float, default=gamma, help="learning-rate factor applied after each epoch (1.0 keeps it constant)")
    parser.add_argument("--seed", type=non_negative_int, default=seed, help="seed for weights, shuffling and every random generator")
    parser.add_argument(
        "--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
        help="autocast precision; default: the launch profile's, else no",
    )
    parser.add_argument(
        "--gradient_accumulation_steps", type=positive_int, default=1,
        help="batches whose gradients are summed before each optimizer step",
    )
    parser.add_argument(
        "--overwrite_output_dir", action="store_true",
        help="start a new run in an output_dir that already holds one (its files are replaced)",
    )
    parser.add_argument(
        "--checkpointing_steps", type=checkpointing_steps, default=None,
        help="save the full training state every N optimizer steps, or after every 'epoch'",
    )
    parser.add_argument(
        "--resume_from_checkpoint", default=None, metavar="PATH|latest",
        help="continue from a checkpoint folder, or the newest under <output_dir>/checkpoints",
    )
    parser.add_argument("--keep_last_checkpoints", type=positive_int, default=None, help="delete all but the newest K checkpoints")
    parser.add_argument(
        "--eval_only", action="store_true",
        help="only evaluate the weights of --resume_from_checkpoint (a checkpoint folder or a model.safetensors)",
    )
    parser.add_argument(
        "--ddp_timeout", type=positive_int, default=1800,
        help="seconds a process waits for the others at a collective before it fails: how soon a run stops "
        "when another machine or the network to it is lost (the main process's download is waited for too)",
    )
    parser.add_argument(
        "--early_stopping_patience", type=positive_int, default=None,
        help="stop when eval loss has not improved for this many epochs (a resumed run remembers its count)",
    )
    parser.add_argument(
        "--early_stopping_target", type=accuracy, default=None, metavar="ACC",
        help="stop after the first epoch whose eval accuracy reaches ACC (between 0 and 1), as time-to-accuracy benchmarks do",
    )
    parser.add_argument(
        "--ddp_comm_hook", choices=["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"], default="no",
        help="compress DDP's gradient all-reduce: fp16/bf16 halve its bytes, PowerSGD sends a low-rank approximation "
        "(see benchmarks/README.md for what each buys and costs)",
    )
    parser.add_argument(
        "--ddp_bucket_cap_mb", type=positive_float, default=None,
        help="DDP's gradient bucket size in MB (torch's default: 25): smaller buckets start their all-reduce "
        "earlier in backward, which --profile shows",
    )
    parser.add_argument(
        "--profile", action="store_true",
        help="record a window of training steps with torch.profiler: traces under <output_dir>/profile/ and a table "
        "of where a step's time goes on each process",
    )
    parser.add_argument("--with_tracking", action="store_true", help="log hyperparameters and epoch metrics to --report_to")
    parser.add_argument(
        "--report_to", choices=["tensorboard", "mlflow", "all"], default=None,
        help="tracker for --with_tracking, stored under --output_dir (default: tensorboard)",
    )
    return parser


def add_mnist_flags(parser, hub_name):
    """Flags of the scripts that read an MNIST-family data set."""
    parser.add_argument("--data_dir", default="./data", help="where data sets are cached (downloaded once per machine)")
    parser.add_argument("--num_workers", type=non_negative_int, default=0, help="DataLoader worker processes per training process")
    parser.add_argument(
        "--dataset_source", choices=["torchvision", "hub"], default="torchvision",
        help="torchvision's download, or the Hugging Face Hub through the datasets library",
    )
    parser.add_argument("--dataset_name", default=hub_name, help="with --dataset_source hub: a Hub data set, or a local folder of one")
    parser.add_argument(
        "--data_pipeline", choices=["memory", "torchvision"], default="memory",
        help="memory: decode once, slice batches from tensors on the device; torchvision: the tutorials' "
        "per-sample DataLoader, for data that does not fit in memory",
    )


def batch_size_per_process(batch_size, num_processes, split):
    """Each process's training batch: --batch_size split evenly across the processes, or all of it when
    not `split` (--no_split_batches). (accelerate's own DataLoaderConfiguration(split_batches=True) splits every
    prepared loader, the evaluation batch of 1,000 too, which 3 processes cannot split, and does not
    reach the in-memory loader; the scripts pass this size to their training loader instead.)"""
    if not split:
        return batch_size
    if batch_size % num_processes:
        raise UserError(
            f"--batch_size {batch_size} does not split evenly across {num_processes} processes: pass a multiple of "
            f"{num_processes}, or --no_split_batches to give every process a batch of {batch_size}."
        )
    return batch_size // num_processes


def check_accumulation(accumulation_steps, batches_per_epoch):
    """Stop when one accumulation window would be longer than an epoch: accelerate ends the window at
    the epoch's end and divides by the whole window, so every epoch would take one small step."""
    if accumulation_steps > batches_per_epoch:
        raise UserError(
            f"--gradient_accumulation_steps {accumulation_steps} is more than the {batches_per_epoch} batches "
            f"each process trains in an epoch, so every epoch would take one small optimizer step: pass at most "
            f"{batches_per_epoch}, or a smaller --batch_size."
        )
