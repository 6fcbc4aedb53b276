"""InMemoryLoader: training batches sliced from a data set held in tensors on the device (the
--data_pipeline memory, the default), in the order and sharding of accelerate's prepared DataLoader."""

import copy
import math

import torch
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.state import GradientState


class InMemoryLoader(DataLoaderStateMixin):
    """The batches of accelerate's prepared DataLoader with a seeded sampler, from a TensorDataset of
    (inputs, labels): per epoch one permutation from seed + epoch, the same on every process; global
    batch k goes to process k mod N; with several processes the last batches are topped up from the
    start of the permutation, so that all take the same number of steps. accelerator.prepare leaves it
    as it is, and accelerator.skip_first_batches does not know it: it has its own skip_first_batches.

    Why not a DataLoader over a Dataset whose __getitems__ slices a whole batch, which accelerate would
    shard, skip and resume itself? Measured at commit 8232cea (benchmarks/README.md): the same weights,
    at 0.87 of this loader's samples/s for cpu_gloo.py on one process and 0.84 on two: per batch its
    sampler, batch sampler and accelerate's prefetching wrapper cost more than the linear net's step."""

    def __init__(self, dataset, batch_size, accelerator, seed, home=None):
        """`home`: the device that holds the data set; by default the accelerator's, unless the set would
        take over a quarter of a GPU's free memory (then the CPU, and each batch moves to the GPU)."""
        inputs, labels = dataset.tensors
        home = home or accelerator.device
        if home.type == "cuda" and inputs.numel() * inputs.element_size() > torch.cuda.mem_get_info(home)[0] // 4:
            home = torch.device("cpu")
        self.inputs, self.labels, self.batch_size, self.seed = inputs.to(home), labels.to(home), batch_size, seed
        self.accelerator, self.skip_batches, self.epoch = accelerator, 0, 0
        # DataLoaderStateMixin: tells accelerator.accumulate when the epoch ends, so that a last partial accumulation
        # window still ends in an optimizer step, and gather_for_metrics how much of the last batch is not top-up
        # (begin() reads the data set's length and total_batch_size where the loader does not drop the last batch).
        self.gradient_state, self._drop_last, self.dataset = GradientState(), False, dataset

    @property
    def total_batch_size(self):
        return self.batch_size * self.accelerator.num_processes

    def __len__(self):
        return math.ceil(len(self.labels) / (self.batch_size * self.accelerator.num_processes)) - self.skip_batches

    def set_epoch(self, epoch):
        self.epoch = epoch

    def skip_first_batches(self, num_batches):
        """This epoch's batches after the first num_batches, as accelerator.skip_first_batches gives them."""
        skipped = copy.copy(self)
        skipped.skip_batches = num_batches
        return skipped

    def this_process_batches(self):
        """The sample indices of this process's batches in this epoch, on the data's device, one row
        per batch (the last row shorter with one process)."""
        num_samples, world_size = len(self.labels), self.accelerator.num_processes
        order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        if world_size == 1:
            return list(order.to(self.inputs.device).split(self.batch_size))
        steps = math.ceil(num_samples / (self.batch_size * world_size))
        total = steps * world_size * self.batch_size
        order = order.repeat(math.ceil(total / num_samples))[:total]  # the top-up comes from the start
        return list(order.view(steps, world_size, self.batch_size)[:, self.accelerator.process_index].to(self.inputs.device))

    def __iter__(self):
        batches = self.this_process_batches()
        device = self.accelerator.device  # where the data set did not fit, each batch moves there
        self.begin()
        for step in range(self.skip_batches, len(batches)):
            self.end_of_dataloader = step == len(batches) - 1
            # index_select gathers the same rows as inputs[rows], about 3x faster on a CPU.
            inputs, labels = self.inputs.index_select(0, batches[step]), self.labels.index_select(0, batches[step])
            yield inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        self.end()
        self.epoch += 1  # after a whole pass, as accelerate's seedable sampler: a loop without set_epoch still reshuffles
