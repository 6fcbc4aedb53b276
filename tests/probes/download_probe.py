"""Launched by the tests like a training script: loads a data file through shared.data's download
order, "downloading" it (writing it, slowly) when it is not there, and records what each rank did.
With --offline the download fails as it does without a network."""

import json
import sys
import time
from pathlib import Path

from accelerate import Accelerator

from shared import data, runtime


def main():
    folder, offline = Path(sys.argv[1]), "--offline" in sys.argv
    accelerator = Accelerator(cpu=runtime.cpu_only())
    data_file = folder / "data.txt"
    record = {"rank": accelerator.process_index, "world_size": accelerator.num_processes}

    def load():
        started = time.time()
        downloaded = not data_file.exists()
        if downloaded:
            if offline:
                raise runtime.UserError(f"{data_file} could not be downloaded: connect to the internet.")
            time.sleep(1)  # a slow download: the others must wait for it, not start their own
            data_file.write_text("the data")
        return {"started": started, "ended": time.time(), "downloaded": downloaded, "read": data_file.read_text()}

    try:
        record.update(data.load_in_download_order(accelerator, load))
    except runtime.UserError as error:  # every rank must get here, none may crash waiting
        record["error"] = str(error)
        raise
    finally:
        (folder / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    runtime.run_main(main)
