"""Load a Hub data set through shared/mnist_data.py against a stand-in Hub: a socket of ours that
counts the connections made to it and closes each at once. Prints that count as JSON, with the
sizes of the splits loaded or the sentence that says why none were.

    python hub_requests.py DATA_DIR --download|--read
"""

import json
import os
import socket
import sys
import threading

server = socket.create_server(("127.0.0.1", 0))
connections = []


def serve():
    while True:
        connection, _ = server.accept()
        connections.append(1)
        connection.close()


threading.Thread(target=serve, daemon=True).start()
os.environ["HF_ENDPOINT"] = f"http://127.0.0.1:{server.getsockname()[1]}"  # read when datasets is imported

from shared import mnist_data  # noqa: E402
from shared.errors import UserError  # noqa: E402

try:
    splits = mnist_data.load("MNIST", sys.argv[1], download=sys.argv[2] == "--download", source="hub", hub_name="someone/mnist",
                             pipeline="memory")
except UserError as error:  # no such data set at the stand-in, nor in an empty cache
    print(json.dumps({"connections": len(connections), "error": str(error)}))
else:
    print(json.dumps({"connections": len(connections), "samples": [len(split) for split in splits]}))
