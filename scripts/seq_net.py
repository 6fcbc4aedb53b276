"""Sequential net 784-200-200-10 on FashionMNIST (tutorial 000), data-parallel through Hugging Face Accelerate.

Run on one process:           python scripts/seq_net.py
On 4 CPU processes (gloo):    python scripts/launch.py --config_file accelerate_configs/cpu.yaml scripts/seq_net.py
On 4 GPUs:                    accelerate launch --config_file accelerate_configs/4gpu.yaml scripts/seq_net.py
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import broadcast, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from shared import (agreement, checkpoints, ddp_options, devices, errors, evaluation, flags, metrics, mnist_data, profiling,
                    run_folder, stop_together, tracking)
from shared.early_stopping import EarlyStopping
from shared.in_memory_loader import InMemoryLoader
from shared.preemption import Preemption, ignore_stop_signals


class SeqNet(nn.Module):
    """The tutorial's 784-200-200-10 net with a sigmoid after each hidden layer, logits out.

    The tutorial put a log_softmax after lin2, as a hidden activation, which squeezes the 200 hidden
    values into log-probabilities and caps what lin3 can learn (cross-entropy already applies the
    log_softmax to lin3's logits). A sigmoid in its place, like after lin1, lifts eval accuracy on
    the real-digit subset from 0.807 to 0.928 after the default 10 epochs (one process; benchmarks/defaults.md).
    """

    def __init__(self, input_size=784, hidden_size1=200, hidden_size2=200, output_size=10):
        super().__init__()
        self.lin1 = nn.Linear(input_size, hidden_size1)
        self.lin2 = nn.Linear(hidden_size1, hidden_size2)
        self.lin3 = nn.Linear(hidden_size2, output_size)

    def forward(self, x):
        x = torch.sigmoid(self.lin1(torch.flatten(x, 1)))
        x = torch.sigmoid(self.lin2(x))
        return self.lin3(x)


DATA_SET, NUM_CLASSES = "FashionMNIST", 10
NORMALIZE = False  # pixels in [0, 1] from ToTensor alone, as the tutorial meant (it divided by 255 a second time)
loss_function = F.cross_entropy  # SeqNet returns logits


def parse_args(argv=None):
    parser = flags.training_parser(__doc__, output_dir="runs/seq_net", hub_name="zalando-datasets/fashion_mnist")
    # The tutorial's Adam at lr 0.01 for 10 epochs. Batch 200, not its 100: 100 does not split over the 8 processes of
    # 8gpu.yaml and 2node_4gpu.yaml; 200 does, and divides FashionMNIST's 60,000 samples, so no epoch ends in a ragged batch.
    parser.add_argument("--num_epochs", type=flags.positive_int, default=10, help="passes over the training set")
    parser.add_argument("--batch_size", type=flags.positive_int, default=200, help=flags.BATCH_SIZE_HELP)
    parser.add_argument("--eval_batch_size", type=flags.positive_int, default=1000, help="evaluation batch size per process")
    parser.add_argument("--lr", type=flags.learning_rate, default=0.01, help="Adam's learning rate (the same at every world size)")
    parser.add_argument("--gamma", type=flags.positive_float, default=1.0, help="learning-rate factor applied after each epoch")
    return parser.parse_args(argv)


@torch.no_grad()
def evaluate(model, loader, accelerator):
    """Every process must call this (it gathers): loss and accuracy over the whole test set, each sample
    counted once, the same on every process."""
    for buffer in model.buffers():  # BatchNorm's running statistics, which each process updated on its own batches:
        broadcast(buffer)  # the main process's, the ones saved, so that every process evaluates the same model
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    correct, total = (torch.zeros(NUM_CLASSES, dtype=torch.long, device=accelerator.device) for _ in range(2))
    for images, labels in loader:
        outputs = model(images).float()
        losses = loss_function(outputs, labels, reduction="none")
        # Every process's results, less the samples the prepared loader repeated to even out the last batch.
        losses, predictions, labels = accelerator.gather_for_metrics((losses, outputs.argmax(dim=1), labels))
        loss_sum += losses.double().sum()
        total += torch.bincount(labels, minlength=NUM_CLASSES)
        correct += torch.bincount(labels[predictions == labels], minlength=NUM_CLASSES)
    model.train()
    count = int(total.sum())  # sums stay on the device until here: no sync per batch
    return {"eval_loss": loss_sum.item() / count, "eval_accuracy": int(correct.sum()) / count, "eval_samples": count,
            "eval_per_class_accuracy": [c / n if n else None for c, n in zip(correct.tolist(), total.tolist())]}


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator(
        cpu=devices.cpu_only(),  # on a machine without GPUs, so that a launch's processes join one gloo group
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # The shuffle order depends only on the seed and the epoch, identically on every process.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        # The scheduler is stepped once per epoch, below; accelerate would step it at every optimizer step.
        step_scheduler_with_optimizer=False,
        kwargs_handlers=ddp_options.kwargs_handlers(args.ddp_timeout, args.ddp_comm_hook, args.ddp_bucket_cap_mb),
        log_with=tracking.log_with(args.with_tracking, args.report_to),  # None unless --with_tracking
        project_config=tracking.project_config(args.output_dir),  # tracker stores under --output_dir
    )
    set_seed(args.seed)
    # Every process: the same flags, code, packages and launch profile everywhere, or all stop naming the difference.
    agreement.check(accelerator, vars(args))
    flags.check_precision(accelerator)  # every process: fp16 on the CPU would quietly train in fp32
    # --batch_size samples per step, split across the processes: any world size trains the same model.
    batch_size = flags.batch_size_per_process(args.batch_size, accelerator.num_processes, split=args.split_batches and not args.eval_only)
    # The main process downloads first, then each other machine's first (its own copy, if its disk is not
    # shared), then the rest read the files, downloading nothing. A failure stops every process with its sentence.
    with accelerator.main_process_first(), accelerator.local_main_process_first(), stop_together.FailureCaught() as loading:
        train_set, test_set = mnist_data.load(DATA_SET, args.data_dir, download=accelerator.is_local_main_process,
                                              source=args.dataset_source, hub_name=args.dataset_name,
                                              pipeline=args.data_pipeline, normalize=NORMALIZE)
    loading.raise_everywhere()  # every process
    agreement.check_data(accelerator, train_set, test_set)  # every process: each machine's copy of the data is the same
    # --data_pipeline memory: batches sliced from the decoded set on the device; torchvision: the tutorials' DataLoader.
    if args.data_pipeline == "memory":
        train_loader = InMemoryLoader(train_set, batch_size, accelerator, seed=args.seed)
    else:
        # A generator of its own, for its workers' seeds: a resume's new iterator then leaves torch's random state (dropout's) as saved.
        train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, num_workers=args.num_workers,
                                  worker_init_fn=ignore_stop_signals, generator=torch.Generator().manual_seed(args.seed))
    test_loader = DataLoader(test_set, batch_size=args.eval_batch_size, num_workers=args.num_workers, worker_init_fn=ignore_stop_signals)

    model = SeqNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    # prepare() wraps the model in DDP (or FSDP), moves it to the device and shards the DataLoaders
    # across the processes (the in-memory loader shards itself the same way and passes through).
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, test_loader, scheduler)
    if not args.eval_only:  # which takes no step
        flags.check_accumulation(accelerator.gradient_accumulation_steps, len(train_loader))
        flags.check_batch_fits(args.batch_size, len(train_set), split=args.split_batches)
    # Every process: refuses an --output_dir that holds an earlier run or a live one. Only here, after every check that
    # could stop the run before it trains but those of a resume and a tracker, does --overwrite_output_dir set it aside.
    output_dir, shared_disk = run_folder.prepare(accelerator, args.output_dir, overwrite=args.overwrite_output_dir,
                                                 resuming=run_folder.resumes_here(args.resume_from_checkpoint, args.output_dir) or args.eval_only)
    accelerator.project_configuration.save_on_each_node = not shared_disk  # then each machine saves its own copy

    if args.eval_only:  # evaluate the weights of --resume_from_checkpoint over all processes, then stop
        weights, is_model_file = evaluation.weights_to_evaluate(accelerator, args.resume_from_checkpoint, output_dir)  # every process
        if is_model_file:
            evaluation.load_model_file(accelerator, model, weights)  # every process
        else:
            with checkpoints.loading(weights, accelerator):  # every process: a failed load stops all
                accelerator.load_state(weights)
            agreement.check_weights(accelerator, model)  # every process: where each machine loaded its own copy, the same weights
        evaluation.report(evaluate(model, test_loader, accelerator), weights, accelerator, output_dir)  # every process
        accelerator.free_memory()  # let go of the DDP model: its process group ends now, not in interpreter shutdown
        accelerator.end_training()
        return

    log = metrics.MetricsLog(output_dir, accelerator)
    saved = checkpoints.Checkpoints(accelerator, output_dir, every=args.checkpointing_steps, keep=args.keep_last_checkpoints,
                                    batch_size=batch_size, batches_per_epoch=len(train_loader), num_epochs=args.num_epochs,
                                    trained_on=checkpoints.trained_on(DATA_SET, args.seed, train_set, test_set))
    # With checkpoints, SIGTERM or SIGUSR1 to any process saves one, then stops (shared/preemption.py).
    preemption = Preemption(accelerator, enabled=bool(args.checkpointing_steps))
    start = checkpoints.Position()  # a new run: epoch 1, nothing trained yet
    if args.resume_from_checkpoint:
        # Every process: the checkpoint to resume (`latest`: the newest intact one), checked, and where it stopped.
        start = saved.where_to_resume(args.resume_from_checkpoint, max_train_steps=args.max_train_steps, split_batches=args.split_batches)
        if start.path:  # none where `latest` finds no checkpoint yet: a new run
            with checkpoints.loading(start.path, accelerator, start):  # every process
                accelerator.load_state(start.path)  # weights, optimizer, scheduler and every process's RNG state
            agreement.check_weights(accelerator, model)  # every process: where each machine loaded its own copy, the same weights
            checkpoints.apply_flags_schedule(accelerator, scheduler, lr=args.lr, gamma=args.gamma)
    # Every process: a resumed run that had already stopped early stops with a sentence.
    early_stopping = EarlyStopping(accelerator, output_dir, start, patience=args.early_stopping_patience, target=args.early_stopping_target)
    # Every process: a tracker that fails to start stops all; one that fails later warns and is left out, not the run.
    if args.with_tracking:
        with tracking.starting(accelerator, output_dir, args.report_to, start) as init_kwargs:
            accelerator.init_trackers("seq_net", config=tracking.hyperparameters(vars(args)), init_kwargs=init_kwargs)
    # Every process, now that nothing refuses the resume: the run goes on from the checkpoint, its later
    # checkpoints set aside and only the records of the epochs before it kept; the run it replaces goes.
    run_folder.replaced_run_goes()
    saved.branch_at(start)
    log.continue_from(start)
    num_epochs = args.num_epochs
    if args.max_train_steps:  # it overrides --num_epochs, as in Hugging Face's example scripts: the epochs that reach it from
        # the start, in this run's steps (a checkpoint's epochs may have been of another length: another batch or world size)
        steps_per_epoch = math.ceil(len(train_loader) / accelerator.gradient_accumulation_steps)
        steps_before_epoch = start.global_step - math.ceil(start.batches_done / accelerator.gradient_accumulation_steps)
        num_epochs = start.epoch - 1 + math.ceil((args.max_train_steps - steps_before_epoch) / steps_per_epoch)

    step = start.global_step
    # --profile: torch.profiler records a window of steps on every process and writes their traces.
    with accelerator.profile(profiling.window(accelerator, output_dir, model)) if args.profile else profiling.off() as profiler:
        for epoch in range(start.epoch, num_epochs + 1):
            model.train()
            train_loader.set_epoch(epoch)  # the epoch's shuffle order, the same on every process
            resuming = epoch == start.epoch and start.batches_done > 0
            batches = train_loader
            if resuming:  # the batches after those the checkpoint had trained
                batches = (train_loader.skip_first_batches(start.batches_done) if args.data_pipeline == "memory"
                           else accelerator.skip_first_batches(train_loader, start.batches_done))
            stats = metrics.EpochStats(accelerator, model, epoch, carried_over=start if resuming else None)
            for images, labels in tqdm(batches, desc=f"epoch {epoch}", disable=not accelerator.is_local_main_process):
                if step == args.max_train_steps:  # mid-epoch too, or already by the checkpoint resumed:
                    break  # the epoch so far is evaluated and recorded, then the model saved
                with accelerator.accumulate(model):
                    loss = loss_function(model(images).float(), labels)  # fp32 whatever the model computes in
                    accelerator.backward(loss)  # gradients are averaged across processes here
                    optimizer.step()
                    optimizer.zero_grad()
                stats.add(loss, len(labels))
                profiler.step()  # --profile: one more step of its window
                if accelerator.sync_gradients:  # an optimizer step happened
                    step += 1
                    # Every process, every 10 steps and at the epoch's last (before its evaluation); at the last of
                    # --max_train_steps the run finishes instead (its model, not a checkpoint).
                    stopping = preemption.stop_agreed(step, epoch_ends=stats.batches == len(train_loader), last_step=step == args.max_train_steps)
                    if stopping or saved.due(step):
                        for buffer in model.buffers():  # BatchNorm's statistics, each process's own until evaluate():
                            broadcast(buffer)  # the main process's, as there (FSDP's sharded save takes any process's copy)
                        with saved.saving(epoch, step, stats) as folder:  # every process; renamed once complete
                            accelerator.save_state(folder)
                    if stopping:
                        raise errors.Stopped(f"saved {saved.newest} after step {step}; continue with --resume_from_checkpoint latest.")
            trained = stats.summary()  # every process: the epoch's loss (stops a diverged run), samples/s, peak memory
            whole_epoch = stats.batches == len(train_loader)  # not one that --max_train_steps cut short

            # Every process: the main process writes the record, and a failed write stops all of them.
            record = log.write(epoch, trained, evaluate(model, test_loader, accelerator),
                               {"step": step, "lr": scheduler.get_last_lr()[0], "whole_epoch": whole_epoch})
            scheduler.step()  # after the record, which holds the rate this epoch trained at
            accelerator.print(metrics.epoch_line(record, num_epochs))
            accelerator.log(tracking.scalars(record), step=epoch)
            if reason := early_stopping.reason_to_stop(record):  # every process: all stop after the same epoch
                accelerator.print(f"Stopped early after epoch {epoch}: {reason}.")
                break  # without a checkpoint: a kill before the model is saved resumes to train this epoch again
            if saved.due_after_epoch(whole_epoch):
                with saved.saving(epoch + 1, step) as folder:  # every process
                    accelerator.save_state(folder)

    accelerator.wait_for_everyone()
    # model.safetensors from the main process, unwrapped from DDP and torch.compile so that it loads into
    # the plain SeqNet. A failed write stops every process with one sentence.
    with stop_together.if_write_fails(output_dir / run_folder.MODEL_FILE, "free space or fix the folder, then finish the run with "
                                      "--resume_from_checkpoint latest (without checkpoints: train again with --overwrite_output_dir)."):
        accelerator.save_model(accelerator.unwrap_model(model, keep_torch_compile=False), output_dir)
    accelerator.print(f"Saved the trained model to {output_dir / run_folder.MODEL_FILE}")
    accelerator.free_memory()  # let go of the DDP model: its process group ends now, not in interpreter shutdown
    accelerator.end_training()


if __name__ == "__main__":
    errors.run_main(main, flags.OUT_OF_MEMORY_ADVICE)  # what to lower, out of memory: the flags it has
