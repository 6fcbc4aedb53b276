"""Launched by the tests like a training script: loads a data file through shared.data's download
order, "downloading" it (writing it, slowly) when it is not there, and records what each rank did."""

import json
import sys
import time
from pathlib import Path

from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shared import data, runtime  # noqa: E402


def main():
    folder = Path(sys.argv[1])
    accelerator = Accelerator(cpu=runtime.cpu_only())
    data_file = folder / "data.txt"

    def load():
        started = time.time()
        downloaded = not data_file.exists()
        if downloaded:
            time.sleep(1)  # a slow download: the others must wait for it, not start their own
            data_file.write_text("the data")
        return {"started": started, "ended": time.time(), "downloaded": downloaded, "read": data_file.read_text()}

    record = data.load_in_download_order(accelerator, load)
    record.update(rank=accelerator.process_index, world_size=accelerator.num_processes)
    (folder / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    runtime.run_main(main)
