"""Linear net on MNIST as 4 CPU processes in one gloo group (tutorial 004), through Hugging Face Accelerate.

The tutorial set MASTER_ADDR/PORT and spawned the processes itself; here the launcher does both:
    accelerate launch --config_file accelerate_configs/cpu.yaml scripts/cpu_gloo.py
    accelerate launch --config_file accelerate_configs/cpu.yaml --num_processes 2 scripts/cpu_gloo.py
One process, no group:  python scripts/cpu_gloo.py
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from shared import checkpoints, cli, data, metrics, profiling, run_folder, runtime, tracking
from shared.early_stopping import EarlyStopping


class SimpleNet(nn.Module):
    """One Linear layer from the 784 pixels to 10 logits."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(28 * 28, 10)

    def forward(self, x):
        return self.fc(torch.flatten(x, 1))


DATA_SET = "MNIST"
loss_function = F.cross_entropy  # SimpleNet returns logits


def make_optimizer(model, args):
    return torch.optim.SGD(model.parameters(), lr=args.lr)


def parse_args(argv=None):
    parser = cli.training_parser(__doc__, name="cpu_gloo", num_epochs=5, batch_size=64, lr=0.01, eval_batch_size=1000)
    cli.add_mnist_flags(parser, hub_name="ylecun/mnist")
    parser.add_argument("--log_interval", type=cli.positive_int, default=100, help="batches between the lines of every rank's loss")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    trackers = tracking.log_with(args.with_tracking, args.report_to)  # None unless --with_tracking
    accelerator = Accelerator(
        cpu=True,  # this tutorial is about CPU processes over gloo, even on a machine with GPUs
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # The shuffle order depends only on the seed and the epoch, identically on every process.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        # The scheduler is stepped once per epoch, below; accelerate would step it at every optimizer step.
        step_scheduler_with_optimizer=False,
        # --ddp_timeout, --ddp_comm_hook, --ddp_bucket_cap_mb; at 3+ processes one gradient layout all run long,
        # so a run with or without checkpoints, resumed or not, ends bitwise the same.
        kwargs_handlers=runtime.distributed_kwargs(args.ddp_timeout, args.ddp_comm_hook, args.ddp_bucket_cap_mb),
        log_with=trackers,
        project_config=tracking.project_config(args.output_dir, trackers),  # tracker stores under --output_dir
    )
    set_seed(args.seed)
    # Every process trains the same: the same training flags, code and packages, or all stop naming the difference.
    runtime.check_processes_agree(accelerator, vars(args))
    # Refuses an --output_dir that holds an earlier run or a live one, before anything is written.
    output_dir = run_folder.prepare(accelerator, args.output_dir, overwrite=args.overwrite_output_dir,
                                    resuming=bool(args.resume_from_checkpoint) or args.eval_only)

    # --batch_size samples per step, split across the processes: any world size trains the same model.
    batch_size = cli.batch_size_per_process(args.batch_size, accelerator.num_processes, split=args.split_batches and not args.eval_only)
    # Both pipelines give the same batches; see --data_pipeline and shared/data.py.
    train_loader, test_loader = data.mnist_loaders(
        accelerator, DATA_SET, batch_size, args.eval_batch_size, data_dir=args.data_dir, source=args.dataset_source,
        hub_name=args.dataset_name, pipeline=args.data_pipeline, num_workers=args.num_workers, seed=args.seed,
    )

    model = SimpleNet()
    optimizer = make_optimizer(model, args)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    # prepare() wraps the model in DDP, moves it to the device and shards DataLoaders across
    # processes (the in-memory loader shards itself the same way and passes through unchanged).
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, test_loader, scheduler
    )

    if args.eval_only:  # evaluate the weights of --resume_from_checkpoint over all processes, then stop
        weights = checkpoints.load_weights(args.resume_from_checkpoint, accelerator, model, output_dir)
        results = metrics.evaluate(model, test_loader, accelerator, loss_function, num_classes=10)
        metrics.report_eval(results, weights, accelerator, output_dir)
        accelerator.free_memory()  # let go of the DDP model: its process group ends now, not in interpreter shutdown
        accelerator.end_training()
        return

    cli.check_accumulation(args.gradient_accumulation_steps, len(train_loader))
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    # --max_train_steps overrides --num_epochs, as in Hugging Face's example scripts.
    num_epochs = math.ceil(args.max_train_steps / steps_per_epoch) if args.max_train_steps else args.num_epochs
    metrics_log = metrics.MetricsLog(output_dir, accelerator)
    checkpointer = checkpoints.Checkpointer(accelerator, output_dir, every=args.checkpointing_steps, keep=args.keep_last_checkpoints,
                                            batch_size=batch_size, num_epochs=num_epochs)
    # With checkpoints, SIGTERM or SIGUSR1 to any process saves one, then stops.
    preemption = runtime.Preemption(accelerator, enabled=bool(args.checkpointing_steps))
    start = checkpoints.Position()  # a new run: epoch 1, nothing trained yet
    if args.resume_from_checkpoint:
        # Every process loads its saved state: weights, optimizer, RNG.
        start = checkpointer.resume(args.resume_from_checkpoint, max_train_steps=args.max_train_steps, split_batches=args.split_batches)
        metrics_log.continue_from(start)
    early_stopping = EarlyStopping(accelerator, output_dir, patience=args.early_stopping_patience, target=args.early_stopping_target)
    if args.with_tracking:
        accelerator.init_trackers("cpu_gloo", config=tracking.hyperparameters(vars(args)), init_kwargs=tracking.init_kwargs(output_dir))

    step = start.global_step
    # --profile: torch.profiler records a window of steps on every process, then writes traces and a table.
    with accelerator.profile(profiling.window(accelerator, output_dir, model)) if args.profile else profiling.off() as profiler:
        for epoch in range(start.epoch, num_epochs + 1):
            model.train()
            train_loader.set_epoch(epoch)  # the epoch's shuffle order, the same on every process
            resuming = epoch == start.epoch and start.batches_done > 0
            batches = data.skip_first_batches(accelerator, train_loader, start.batches_done) if resuming else train_loader
            stats = metrics.EpochStats(accelerator, carried_over=start if resuming else None)
            progress_bar = tqdm(batches, desc=f"epoch {epoch}", disable=not accelerator.is_local_main_process)
            for batch_index, (images, labels) in enumerate(progress_bar, start=stats.batches):  # counts on after a resume
                with accelerator.accumulate(model):
                    loss = loss_function(model(images).float(), labels)  # fp32 whatever the model computes in
                    accelerator.backward(loss)  # gradients are averaged across processes here
                    optimizer.step()
                    optimizer.zero_grad()
                stats.add(loss, len(labels))
                profiler.step()  # --profile: one more step of its window
                if accelerator.sync_gradients:  # an optimizer step happened
                    step += 1
                    stopping = preemption.stop_agreed(step)
                    if stopping or checkpointer.due(step):
                        saved = checkpointer.save(epoch, step, stats)
                    if stopping:
                        raise runtime.Preempted(f"saved {saved} after step {step}; continue with --resume_from_checkpoint latest.")
                    if step == args.max_train_steps:
                        break  # mid-epoch too: the epoch so far is evaluated and recorded, then the model saved
                if batch_index % args.log_interval == 0:  # every rank's own loss, as in the tutorial, in one line from rank 0
                    losses = accelerator.gather(loss.detach().reshape(1)).tolist()
                    if accelerator.is_main_process:
                        progress_bar.write(f"Epoch {epoch}, batch {batch_index}, loss by rank: " + "  ".join(f"{rank}: {value:.4f}" for rank, value in enumerate(losses)))
            scheduler.step()
            trained = stats.summary()  # the epoch's loss, samples/s and peak memory, before evaluation

            results = metrics.evaluate(model, test_loader, accelerator, loss_function, num_classes=10)
            record = metrics_log.write(epoch, trained, results, {"step": step, "lr": scheduler.get_last_lr()[0]})
            accelerator.print(metrics.epoch_line(record, num_epochs))
            accelerator.log(tracking.scalars(record), step=epoch)
            if args.checkpointing_steps == "epoch" and stats.batches == len(train_loader):  # a whole epoch
                checkpointer.save(epoch + 1, step)
            if reason := early_stopping.stop_after(record):  # the same epoch on every process
                accelerator.print(f"Stopped early after epoch {epoch}: {reason}.")
                break

    accelerator.wait_for_everyone()
    # model.safetensors, from the main process only; unwrapped from DDP and torch.compile so that
    # it loads into the plain model class. A failed write stops every process with one sentence.
    with runtime.stop_all_if_write_fails(output_dir / run_folder.MODEL_FILE, "free space or fix the folder, and train again."):
        accelerator.save_model(accelerator.unwrap_model(model, keep_torch_compile=False), output_dir)
    accelerator.print(f"Saved the trained model to {output_dir / run_folder.MODEL_FILE}")
    accelerator.free_memory()  # let go of the DDP model: its process group ends now, not in interpreter shutdown
    accelerator.end_training()


if __name__ == "__main__":
    runtime.run_main(main)
