"""A Ray cluster of several nodes on this machine, held by its own process for a test.

    python -m tests.e2e.ray_cluster SPEC_JSON READY_PATH

SPEC_JSON: `{"temp_dir": ..., "nodes": [{"CPU": 1, "resources": {...}}, ...]}`; the first
node is the head. Each node listens on 127.0.0.1 (`ray.cluster_utils.Cluster`, one raylet
per node). Once every node is up the process writes `{"address": GCS address, "node_ids":
[...]}` to READY_PATH, then holds the cluster until its standard input closes, and shuts
it down (and with it every process the nodes started) before it exits. Holding it in a
process of its own keeps Ray out of the test process, whose later tests start their own.
"""

import json
import sys
from pathlib import Path


def main(spec: dict, ready_path: Path) -> None:
    from ray.cluster_utils import Cluster

    cluster = Cluster(shutdown_at_exit=True)   # and a reaper, should this process die
    try:
        node_ids = []
        for index, node in enumerate(spec["nodes"]):
            options = {"include_dashboard": False} if index == 0 else {}
            started = cluster.add_node(
                num_cpus=node["CPU"], resources=node["resources"], node_ip_address="127.0.0.1",
                temp_dir=spec["temp_dir"], object_store_memory=80 * 2**20, **options)
            node_ids.append(started.node_id)
        cluster.wait_for_nodes()
        ready_path.write_text(json.dumps({"address": cluster.address, "node_ids": node_ids}))
        sys.stdin.read()
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
