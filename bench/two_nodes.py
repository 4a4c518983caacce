"""A real multi-node Ray cluster on one host: a CPU-only head and one node per GPU, each node's
raylet started with its own CUDA_VISIBLE_DEVICES (so Ray gives its workers that GPU only).

Usage:  python -m bench.two_nodes ADDRESS_FILE [--gpus 2] [--cpus-per-node 8]

Writes the cluster's address to ADDRESS_FILE once every node is up, then holds the cluster
until SIGTERM/SIGINT. `ray start --head` + `ray start --address` do the same from a shell; on
the device machine the second node could not reach the head's GCS at the host's address
(docs/experiments/queue.md), while `ray.cluster_utils.Cluster` (loopback, as the CPU tests use it)
can. Used by bench/queue_device.sh (issue 13, parts 2 and 3).
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("address_file", type=Path)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--cpus-per-node", type=int, default=8)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    for gpu in range(args.gpus):
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # read when the node's resources are resolved
        cluster.add_node(num_cpus=args.cpus_per_node, num_gpus=1)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    cluster.wait_for_nodes()
    args.address_file.write_text(cluster.address)
    print(f"cluster at {cluster.address}: head + {args.gpus} GPU nodes", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    cluster.shutdown()


if __name__ == "__main__":
    main()
