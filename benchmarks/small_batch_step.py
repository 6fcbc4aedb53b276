"""mnist_conv's step at the tutorial's batch of 64 on one GPU, where the GPU waits on the host: the
plain PyTorch step against the same step captured once as a CUDA graph and replayed, and both
against the device's own time per step (back-to-back replays: the limit of this model and batch).

    python benchmarks/small_batch_step.py            # on a machine with a CUDA GPU

Both train the script's Net with its optimizer, learning rate and loss from the same weights on the
same batches, sliced from random digits already on the GPU, and the run says whether their weights
end bitwise equal. The graph's optimizer keeps its step on the device (capturable=True), as capture requires.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baselines  # noqa: E402

SCRIPT = "mnist_conv.py"
LOSS, LR = baselines.script_module(SCRIPT).loss_function, baselines.script_defaults(SCRIPT).lr


def make(seed, capturable):
    torch.manual_seed(seed)
    model = baselines.make_model(SCRIPT).cuda()
    return model, baselines.OPTIMIZERS[SCRIPT](model.parameters(), lr=LR, capturable=capturable)


def eager_steps(model, optimizer, batches):
    for inputs, labels in batches:
        baselines.step(model, optimizer, LOSS, inputs, labels)


def graphed_step(model, optimizer, first_batches):
    """The whole step captured as a CUDA graph after warm-up steps on first_batches (trained on, as
    torch's recipe runs them on a side stream); returns a function that trains on one batch."""
    static_inputs, static_labels = (tensor.clone() for tensor in first_batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager_steps(model, optimizer, first_batches)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)  # backward inside the graph then writes the gradients, not adds to them
    with torch.cuda.graph(graph):
        LOSS(model(static_inputs), static_labels).backward()
        optimizer.step()

    def train_on(inputs, labels):
        static_inputs.copy_(inputs)
        static_labels.copy_(labels)
        graph.replay()
    return train_on, graph


def samples_per_sec(run, num_samples):
    torch.cuda.synchronize()
    started = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return num_samples / (time.perf_counter() - started)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3000, help="timed steps of each way")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the capture (and before timing)")
    parser.add_argument("--deterministic", action="store_true", help="cuDNN's deterministic kernels, for the weights' comparison")
    args = parser.parse_args()
    torch.backends.cudnn.deterministic = args.deterministic
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")  # CUDA graphs have no CPU counterpart
    generator = torch.Generator(device="cuda").manual_seed(0)
    count = (args.warmup + args.steps) * args.batch_size
    images = torch.randn(count, 1, 28, 28, device="cuda", generator=generator)
    labels = torch.randint(0, 10, (count,), device="cuda", generator=generator)
    batches = list(zip(images.split(args.batch_size), labels.split(args.batch_size)))
    warmup, timed = batches[:args.warmup], batches[args.warmup:]
    num_samples = len(timed) * args.batch_size

    eager_model, eager_optimizer = make(0, capturable=False)
    eager_steps(eager_model, eager_optimizer, warmup)
    eager = samples_per_sec(lambda: eager_steps(eager_model, eager_optimizer, timed), num_samples)

    graph_model, graph_optimizer = make(0, capturable=True)
    train_on, graph = graphed_step(graph_model, graph_optimizer, warmup)
    graphed = samples_per_sec(lambda: [train_on(*batch) for batch in timed], num_samples)
    # Controls, untimed: eager again (is the eager step itself deterministic here?), and eager with capturable=True.
    controls = {"CUDA graph": {name: value.clone() for name, value in graph_model.state_dict().items()}}  # before the replays below train on
    for name, capturable in (("eager again", False), ("eager, capturable=True", True)):
        model, optimizer = make(0, capturable)
        eager_steps(model, optimizer, warmup + timed)
        controls[name] = model.state_dict()
    # The device's own time per step: replays queued back to back, no new batch copied in (the weights go on changing).
    limit = samples_per_sec(lambda: [graph.replay() for _ in timed], num_samples)

    print(f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}; batch {args.batch_size}; {args.steps} timed steps each; "
          f"cuDNN deterministic: {args.deterministic}.\n")
    print("| step | samples/s | ms per step | of the device's limit |\n|---|---|---|---|")
    for name, rate in (("plain PyTorch, eager", eager), ("CUDA graph of the whole step", graphed), ("device limit (replays back to back)", limit)):
        print(f"| {name} | {rate:,.0f} | {1000 * args.batch_size / rate:.3f} | {rate / limit:.2f} |")
    print("\nWeights after the same steps, against the timed eager run's:")
    for name, weights in controls.items():
        pairs = list(zip(eager_model.state_dict().values(), weights.values()))
        largest = max(float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)) for a, b in pairs)
        print(f"- {name}: {'bitwise equal' if all(torch.equal(a, b) for a, b in pairs) else f'differ, by at most {largest:.1e} of a tensor largest value'}")


if __name__ == "__main__":
    main()
