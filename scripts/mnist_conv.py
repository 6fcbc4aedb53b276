"""Conv net with BatchNorm on MNIST (tutorial 001), data-parallel through Hugging Face Accelerate.

Run on one process:           python scripts/mnist_conv.py
On 4 CPU processes (gloo):    accelerate launch --config_file accelerate_configs/cpu.yaml scripts/mnist_conv.py
On 4 GPUs:                    accelerate launch --config_file accelerate_configs/4gpu.yaml scripts/mnist_conv.py
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from shared import checkpoints, cli, data, metrics, outputs, runtime


class Net(nn.Module):
    """The tutorial's net: two 3x3 convs with BatchNorm, then 1600 -> 128 -> 10, log-probabilities out."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=3, stride=1)
        self.n1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, stride=1)
        self.n2 = nn.BatchNorm2d(64)
        self.fc1 = nn.Linear(1600, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.n1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.n2(self.conv2(x))), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=-1)


def parse_args(argv=None):
    # Adadelta with lr 1.0 and a 0.7 decay per epoch, as pytorch/examples trains this net;
    # the tutorial's lr 0.01 learns far more slowly.
    parser = cli.training_parser(
        __doc__, name="mnist_conv", num_epochs=5, batch_size=64, lr=1.0, gamma=0.7, eval_batch_size=1000
    )
    cli.add_mnist_flags(parser, hub_name="ylecun/mnist")
    parser.add_argument(
        "--channels_last", action="store_true",
        help="keep the conv activations in NHWC order, which the GPU's fastest bf16 and fp16 convolutions use",
    )
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator(
        cpu=runtime.cpu_only(),
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # The shuffle order depends only on the seed and the epoch, identically on every process.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        # The scheduler below is stepped once per epoch; by default accelerate would step it
        # once per process at every optimizer step.
        step_scheduler_with_optimizer=False,
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

    model = Net()
    if args.channels_last:  # the weights in NHWC order; the convolutions then give NHWC activations
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    # prepare() wraps the model in DDP, moves it to the device and shards DataLoaders across
    # processes (the in-memory loader shards itself the same way and passes through unchanged).
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, test_loader, scheduler
    )

    metrics_log = outputs.MetricsLog(output_dir, accelerator)
    checkpointer = checkpoints.Checkpointer(args, accelerator, output_dir, metrics_log, batch_size)
    if args.eval_only:
        return checkpointer.evaluate_only(model, test_loader, F.nll_loss, num_classes=10)
    start = checkpointer.resume()  # epoch 1 of a new run, or where --resume_from_checkpoint stopped
    if args.with_tracking:
        accelerator.init_trackers("mnist_conv", config=outputs.hyperparameters(args))

    for epoch in range(start.epoch, args.num_epochs + 1):
        model.train()
        train_loader.set_epoch(epoch)
        resumed = start if epoch == start.epoch else None
        batches = data.skip_first_batches(accelerator, train_loader, start.batches_done) if resumed else train_loader
        stats = metrics.EpochStats(accelerator, resumed)
        for images, labels in tqdm(batches, desc=f"epoch {epoch}", disable=not accelerator.is_local_main_process):
            with accelerator.accumulate(model):
                loss = F.nll_loss(model(images), labels)
                accelerator.backward(loss)  # gradients are averaged across processes here
                optimizer.step()
                optimizer.zero_grad()
            stats.add(loss, len(labels))
            if accelerator.sync_gradients:  # an optimizer step happened
                checkpointer.step_done(epoch, stats)
        scheduler.step()

        train_metrics = stats.finish()
        eval_metrics = metrics.evaluate(model, test_loader, accelerator, F.nll_loss, num_classes=10)
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
