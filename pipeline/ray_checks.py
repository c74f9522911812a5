"""The Ray executor's checks of a cluster before any step runs (pipeline/ray_executor.py joins the cluster and runs
the grid): the address answers and is a Ray head's GCS of this machine's versions, some one node can hold a run's
CPUs and GPUs, and every node sees the results folder. Each failure is one line naming the flag. Ray is imported
inside the functions that need it, so this module imports without Ray.
"""

from __future__ import annotations

import secrets
import socket
from pathlib import Path
from typing import Any

from pipeline.ray_probe import probe_storage
from utils.errors import TaskHetError
from utils.run_dir import atomic_write_text

# A wrong --ray_address is one line within 10 s: the TCP connection, then one call to the GCS, each bounded (Ray's
# own join retries for a minute or more, and against a port that answers another protocol for about 12 minutes).
CONNECT_SECONDS = 4  # a --ray_address that does not accept a TCP connection in this time is unreachable
GCS_SECONDS = 4  # ... and one whose GCS does not answer a key-value read in this time is no Ray cluster
CLUSTER_METADATA = (b"CLUSTER_METADATA", b"cluster")  # the key and namespace where a head records its versions
PROBE_SECONDS = 120  # every node answers the storage check within this time (a busy node starts a worker first)
STORAGE_MARKER = ".ray-storage-check"


def connection_error(address: str, seconds: float) -> str | None:
    """Why nothing accepts a TCP connection at ``address`` (``HOST:PORT``, ``[IPv6]:PORT``, ``ray://`` allowed) within
    ``seconds``; None when something does."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=seconds).close()
    except OSError as error:
        return error.strerror or type(error).__name__
    return None


def accepts_connection(address: str, seconds: float) -> bool:
    """Whether something accepts a TCP connection at ``address`` within ``seconds``."""
    return connection_error(address, seconds) is None


def check_reachable(address: str) -> None:
    """One line when nothing accepts a TCP connection at ``address``'s host and port."""
    reason = connection_error(address, CONNECT_SECONDS)
    if reason is not None:
        raise TaskHetError(f"--ray_address {address}: nothing answers there ({reason}); start a cluster with "
                           "`ray start --head` and pass the address it prints, or leave --ray_address out to start "
                           "Ray on this machine")


def check_gcs(address: str, ray_version: str) -> None:
    """One line when ``address`` answers but is not a Ray head's GCS, or is the GCS of another Ray or Python version
    (a driver and its cluster must run the same): one key-value read of the versions the head recorded, bounded by
    :data:`GCS_SECONDS`."""
    import json
    import sys

    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    key, namespace = CLUSTER_METADATA
    with grpc.insecure_channel(address) as channel:
        try:
            reply = gcs_service_pb2_grpc.InternalKVGcsServiceStub(channel).InternalKVGet(
                gcs_service_pb2.InternalKVGetRequest(key=key, namespace=namespace), timeout=GCS_SECONDS)
        except grpc.RpcError as error:
            detail = ((error.details() or "").strip().splitlines() or [""])[0][:120]
            raise TaskHetError(f"--ray_address {address}: something answers there, but not a Ray cluster's GCS "
                               f"({error.code().name}: {detail}); pass the address `ray start --head` printed") from None
    try:
        metadata = json.loads(reply.value)
        theirs = (str(metadata["ray_version"]), str(metadata["python_version"]))
    except (ValueError, KeyError, TypeError):
        raise TaskHetError(f"--ray_address {address}: the Ray cluster there recorded no Ray and Python versions; "
                           "start it with `ray start --head` from this checkout's .venv") from None
    ours = (ray_version, ".".join(map(str, sys.version_info[:3])))
    if theirs[0] != ours[0] or theirs[1].split(".")[:2] != ours[1].split(".")[:2]:
        raise TaskHetError(f"--ray_address {address}: that cluster runs Ray {theirs[0]} on Python {theirs[1]}, this "
                           f"machine Ray {ours[0]} on Python {ours[1]}; a driver and its cluster need the same Ray and "
                           "Python: start the cluster with this checkout's .venv/bin/ray")


RESOURCE_SLACK = 1e-9  # Ray adds resources as floats: a node of 3 × 0.1 GPU holds a run of 0.3 GPU


def fits(have: tuple[float, float], cpus: float, gpus: float) -> bool:
    """Whether a node with ``have`` = (CPUs, GPUs) holds one run of ``cpus`` CPUs and ``gpus`` GPUs: all of it."""
    return have[0] + RESOURCE_SLACK >= cpus and have[1] + RESOURCE_SLACK >= gpus


def check_resources(nodes: list[dict[str, Any]], cpus: float, gpus: float, cluster: str) -> None:
    """Some one node holds a run's CPUs and GPUs together: Ray places a task on a single node, so a run asking more
    than every node has waits forever, however much the nodes have between them (two 2-CPU nodes never start a
    4-CPU run; a 4-CPU node and a 1-GPU node never start a run of 4 CPUs and 1 GPU).

    Raises:
        TaskHetError: one line naming the flag(s), the largest node's CPUs and GPUs and the cluster's total.
    """
    held = [(float(node["Resources"].get("CPU", 0.0)), float(node["Resources"].get("GPU", 0.0))) for node in nodes]
    if any(fits(have, cpus, gpus) for have in held):
        return
    cpu_short = max((cpu for cpu, _ in held), default=0.0) + RESOURCE_SLACK < cpus
    gpu_short = max((gpu for _, gpu in held), default=0.0) + RESOURCE_SLACK < gpus
    together = not (cpu_short or gpu_short)  # some node has the CPUs, some the GPUs, none both
    named = [(flag, value, key) for flag, value, key, short in (("--cpus_per_run", cpus, "CPU", cpu_short),
                                                                ("--gpus_per_run", gpus, "GPU", gpu_short))
             if short or (together and value > 0)]
    # The largest node: the most GPUs where only GPUs are short, else the most CPUs (a tie: the more of the other).
    by_gpus = gpu_short and not cpu_short
    largest = max(held, key=lambda have: have[::-1] if by_gpus else have, default=(0.0, 0.0))
    total = (sum(cpu for cpu, _ in held), sum(gpu for _, gpu in held))
    raise TaskHetError(f"{' and '.join(f'{flag} {value:g}' for flag, value, _ in named)}: no node of {cluster} has "
                       f"{' and '.join(amount(value, key) for _, value, key in named)}{' together' * together} (the "
                       f"largest node has {amount(largest[0], 'CPU')} and {amount(largest[1], 'GPU')}; "
                       f"{amount(total[0], 'CPU')} and {amount(total[1], 'GPU')} on {len(held)} node(s) together, "
                       "but Ray places a run on one node), so a run would never start")


def amount(value: float, key: str) -> str:
    """``1 GPU``, ``2 GPUs``, ``0.5 GPUs``."""
    return f"{value:g} {key}{'s' * (value != 1)}"


def check_shared_storage(ray: Any, nodes: list[dict[str, Any]], out_dir: Path, cwd: str) -> None:
    """Every node reads a file this driver wrote in ``out_dir`` and writes one back, which the driver reads.

    Runs on a node that sees another folder (a local disk at the same path) would write results the driver never
    reads, or train a run twice: refused here with one line naming the node.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = secrets.token_hex(8)
    marker = out_dir.resolve() / f"{STORAGE_MARKER}-{token}"
    atomic_write_text(marker, token)
    probe = ray.remote(num_cpus=0, max_retries=0)(probe_storage)
    asked = {probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
             .remote(cwd, str(marker), token, node["NodeID"]): node for node in nodes}
    try:
        ready, late = ray.wait(list(asked), num_returns=len(asked), timeout=PROBE_SECONDS)
        for ref in late:
            raise TaskHetError(f"Ray node {node_name(asked[ref])} did not answer the results-folder check within "
                               f"{PROBE_SECONDS} s; is it overloaded, or missing this project's environment?")
        for ref in ready:
            node = asked[ref]
            try:
                problem = ray.get(ref)
            except ray.exceptions.RayError as error:
                reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
                raise TaskHetError(f"Ray node {node_name(node)} could not run this project's code ({reason}): every node "
                                   f"needs this repository at {cwd} and its Python environment") from None
            reply = Path(f"{marker}.{node['NodeID']}")
            if problem is None and not (reply.is_file() and reply.read_text() == token):
                problem = f"what it wrote there, {reply.name}, does not reach this machine"
            if problem is not None:
                raise TaskHetError(f"--results {out_dir} is not on storage every Ray node sees: node {node_name(node)} "
                                   f"{problem}; put --results on a file system every node mounts at the same path "
                                   "(NFS, Lustre, a shared home)")
    finally:
        for path in [marker, *(Path(f"{marker}.{node['NodeID']}") for node in nodes)]:
            path.unlink(missing_ok=True)


def node_name(node: dict[str, Any]) -> str:
    """``10.0.0.5 (host-a)`` for a node of ``ray.nodes()``."""
    return f"{node.get('NodeManagerAddress')} ({node.get('NodeManagerHostname')})"
