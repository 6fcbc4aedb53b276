"""Launched by the tests like a training script: loads a data file in the scripts' download order
(their own lines: accelerate's main_process_first and local_main_process_first around the load, with
stop_together.FailureCaught), "downloading" it (writing it, slowly) when it is not there, and records
what each rank did. With --offline the download fails as it does without a network."""

import json
import sys
import time
from pathlib import Path

from accelerate import Accelerator

from shared.devices import cpu_only
from shared.errors import UserError, run_main
from shared.stop_together import FailureCaught


def main():
    folder, offline = Path(sys.argv[1]), "--offline" in sys.argv
    accelerator = Accelerator(cpu=cpu_only())
    data_file = folder / "data.txt"
    record = {"rank": accelerator.process_index, "world_size": accelerator.num_processes}

    def load(download):
        started = time.time()
        downloaded = not data_file.exists()
        if downloaded:
            if not download:
                raise UserError(f"{data_file} is not there.")
            if offline:
                raise UserError(f"{data_file} could not be downloaded: connect to the internet.")
            time.sleep(1)  # a slow download: the others must wait for it, not start their own
            data_file.write_text("the data")
        return {"started": started, "ended": time.time(), "downloaded": downloaded, "read": data_file.read_text()}

    try:
        with accelerator.main_process_first(), accelerator.local_main_process_first(), FailureCaught() as loading:
            record.update(load(download=accelerator.is_local_main_process))
        loading.raise_everywhere()
    except UserError as error:  # every rank must get here, none may crash waiting
        record["error"] = str(error)
        raise
    finally:
        (folder / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    run_main(main)
