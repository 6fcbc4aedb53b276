"""A survivor of a lost process, as run_main sees one: a collective fails with gloo's "Connection
closed by peer". It says so on stdout, and the test presses Ctrl-C while run_main waits before
leaving, as happens when the launcher passes Ctrl-C to this process after another has already stopped."""

import torch.distributed as dist

from shared.errors import run_main


def main():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    print("lost a peer", flush=True)
    raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40123")


if __name__ == "__main__":
    run_main(main)
