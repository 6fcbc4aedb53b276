"""Linear net on MNIST as 4 CPU processes in one gloo group (tutorial 004), through Hugging Face Accelerate.

The tutorial set MASTER_ADDR/PORT and spawned the processes itself; here the launcher does both:
    accelerate launch --config_file accelerate_configs/cpu.yaml scripts/cpu_gloo.py
    accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 2 scripts/cpu_gloo.py
One process, no group:  python scripts/cpu_gloo.py
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from shared import checkpoints, cli, data, metrics, outputs, runtime


class SimpleNet(nn.Module):
    """One Linear layer from the 784 pixels to 10 logits."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(28 * 28, 10)

    def forward(self, x):
        return self.fc(torch.flatten(x, 1))


def parse_args(argv=None):
    parser = cli.training_parser(__doc__, name="cpu_gloo", num_epochs=5, batch_size=64, lr=0.01, eval_batch_size=1000)
    cli.add_mnist_flags(parser, hub_name="ylecun/mnist")
    parser.add_argument("--log_interval", type=cli.positive_int, default=100, help="batches between per-rank loss lines")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator(
        cpu=True,  # this tutorial is about CPU processes over gloo, even on a machine with GPUs
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # The shuffle order depends only on the seed and the epoch, identically on every process.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        step_scheduler_with_optimizer=False,  # the scheduler is stepped once per epoch, below
        # With checkpoints, DDP keeps one gradient layout, so a resume ends bitwise as if never stopped.
        kwargs_handlers=runtime.ddp_kwargs_for_exact_resume(args),
        log_with=outputs.trackers(args),
        project_config=outputs.project_config(args),
    )
    set_seed(args.seed)
    runtime.cache_accelerate_step_lookups()  # accelerate 1.15 repeats two fixed look-ups at every step
    output_dir = outputs.prepare_output_dir(args, accelerator)

    # --batch_size samples per step, split across the processes: any world size trains the same model.
    batch_size = cli.batch_size_per_process(args, accelerator.num_processes)
    # Both pipelines give the same batches; see --data_pipeline and shared/data.py.
    train_loader, test_loader = data.mnist_loaders(args, "MNIST", accelerator, batch_size)

    model = SimpleNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    # prepare() wraps the model in DDP, moves it to the device and shards DataLoaders across
    # processes (the in-memory loader shards itself the same way and passes through unchanged).
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, test_loader, scheduler
    )

    rank = accelerator.process_index
    metrics_log = outputs.MetricsLog(output_dir, accelerator)
    checkpointer = checkpoints.Checkpointer(args, accelerator, output_dir, metrics_log, batch_size)
    if args.eval_only:
        return checkpointer.evaluate_only(model, test_loader, F.cross_entropy, num_classes=10)
    start = checkpointer.resume()  # epoch 1 of a new run, or where --resume_from_checkpoint stopped
    if args.with_tracking:
        accelerator.init_trackers("cpu_gloo", config=outputs.hyperparameters(args))

    for epoch in range(start.epoch, args.num_epochs + 1):
        model.train()
        train_loader.set_epoch(epoch)
        resumed = start if epoch == start.epoch else None
        batches = data.skip_first_batches(accelerator, train_loader, start.batches_done) if resumed else train_loader
        stats = metrics.EpochStats(accelerator, resumed)
        progress_bar = tqdm(batches, desc=f"epoch {epoch}", disable=not accelerator.is_local_main_process)
        for batch_idx, (images, labels) in enumerate(progress_bar, start=stats.batches):  # counts on after a resume
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(images), labels)
                accelerator.backward(loss)  # gradients are averaged across processes here
                optimizer.step()
                optimizer.zero_grad()
            stats.add(loss, len(labels))
            if accelerator.sync_gradients:  # an optimizer step happened
                checkpointer.step_done(epoch, stats)
            if batch_idx % args.log_interval == 0:  # every rank reports its own loss, as in the tutorial
                print(f"Rank: {rank}, Epoch: {epoch}, Batch: {batch_idx}, Loss: {loss.item():.4f}", flush=True)
        scheduler.step()

        train_metrics = stats.finish()  # summed over all ranks
        eval_metrics = metrics.evaluate(model, test_loader, accelerator, F.cross_entropy, num_classes=10)
        progress = {"step": checkpointer.global_step, "lr": scheduler.get_last_lr()[0]}
        record = metrics_log.write(epoch, train_metrics, eval_metrics, progress)
        accelerator.print(metrics.epoch_line(record, args.num_epochs))
        accelerator.log(outputs.scalars(record), step=epoch)
        checkpointer.epoch_done(epoch)

    accelerator.wait_for_everyone()
    # model.safetensors, from the main process only; unwrapped from DDP and torch.compile so that
    # it loads into the plain model class.
    accelerator.save_model(accelerator.unwrap_model(model, keep_torch_compile=False), output_dir)
    accelerator.end_training()


if __name__ == "__main__":
    runtime.run_main(main)
