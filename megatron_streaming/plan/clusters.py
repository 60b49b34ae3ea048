"""Descriptions of the clusters and of the link between them, read from YAML or JSON.

A cluster file (``launch/clusters/*.yaml`` are examples with public specifications)::

    name: h100-east
    nodes: 8
    devices_per_node: 8
    device_memory_gib: 80
    peak_tflops: 989          # dense, at the training precision (bf16 here)
    mfu: 0.40                 # the GEMMs' sustained fraction of the peak (the unfused
                              # attention's passes through memory are counted apart)
    intra_node_gb_per_s: 450  # per device, one direction (NVLink)
    inter_node_gb_per_s: 50   # per device, one direction (InfiniBand 400 Gb/s)
    runtime_gib: 4            # per rank before the model: CUDA context, NCCL, allocator
    memory_gb_per_s: 3350     # the device's memory bandwidth (the optimizer step's term)
    collective_latency_us: 20 # each blocking collective's cost beyond its bytes (nccl-tests)
    host_memory_gib: 2048     # per node (optional): the plan says when its host line exceeds it

A link file::

    bandwidth_gbit_per_s: 10
    rtt_ms: 80
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Optional

from ..errors import UsageError


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    device_memory_gib: float
    peak_tflops: float
    intra_node_gb_per_s: float
    inter_node_gb_per_s: float
    mfu: float = 0.4
    runtime_gib: float = 4.0
    memory_gb_per_s: float = 0.0  # 0: the step-time model leaves the optimizer step out
    collective_latency_us: float = 0.0  # per blocking collective, on top of its bytes
    host_memory_gib: float = 0.0  # per node; 0: unknown (the plan's host line checks nothing)
    # The cluster's own flags for launch/slurm.sh (partition, account...), passed through.
    sbatch: str = ""

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def fabric(self):
        from .step_time import Fabric

        return Fabric(self.peak_tflops * 1e12 * self.mfu, self.intra_node_gb_per_s * 1e9,
                      self.inter_node_gb_per_s * 1e9, self.devices_per_node,
                      self.memory_gb_per_s * 1e9, self.collective_latency_us * 1e-6)


@dataclass(frozen=True)
class Link:
    bandwidth_gbit_per_s: float
    rtt_ms: float = 0.0
    # Linux's default (net.ipv4.tcp_slow_start_after_idle=1): every exchange after an idle
    # gap starts from TCP's initial window; false where the hosts set it to 0.
    slow_start_after_idle: bool = True


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror}") from None
    if path.endswith(".json"):
        return json.loads(text)
    import yaml

    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    return data


def _build(cls, path: str, data: dict, name: Optional[str] = None):
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise UsageError(f"{path}: unknown field(s) {', '.join(unknown)} (known: "
                         f"{', '.join(sorted(fields))})")
    if name is not None:
        data = {"name": name, **data}
    try:
        out = cls(**data)
    except TypeError as e:
        raise UsageError(f"{path}: {e}") from None
    for f in dataclasses.fields(cls):
        value = getattr(out, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise UsageError(f"{path}: {f.name} must not be negative, got {value}")
    return out


def load_cluster(path: str) -> Cluster:
    import os

    data = _read(path)
    return _build(Cluster, path, data, None if "name" in data else
                  os.path.splitext(os.path.basename(path))[0])


def load_link(path: str) -> Link:
    return _build(Link, path, _read(path))


__all__ = ["Cluster", "Link", "load_cluster", "load_link"]
