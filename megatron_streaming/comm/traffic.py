"""What a data-parallel baseline would put on the wire: the yardstick for the sync's bytes.

Streaming DiLoCo (arXiv 2501.18512) is judged by the bytes it moves between workers against a
data-parallel run of the same model. A data-parallel step averages every gradient over the N
ranks that hold a replica; with a ring all-reduce each of them sends ``2 (N-1)/N`` times the
gradient's size (reduce-scatter, then all-gather). The run's TensorBoard scalars
(``traffic/data_parallel_bytes``) and ``benchmarks/quality_traffic.py`` both count it here, so
the plot and the benchmark compare against the same number.
"""

from __future__ import annotations

FP32_BYTES = 4


def ring_all_reduce_bytes(parameters: int, ranks: int, bytes_per_element: int = FP32_BYTES) -> int:
    """Bytes all ``ranks`` together send to average one gradient of ``parameters`` elements:
    ``ranks x 2 (ranks-1)/ranks x bytes_per_element x parameters`` (0 for one rank)."""
    if parameters < 0 or ranks < 1 or bytes_per_element < 1:
        raise ValueError(f"need parameters >= 0, ranks >= 1, bytes_per_element >= 1; got "
                         f"{parameters}, {ranks}, {bytes_per_element}")
    return 2 * (ranks - 1) * bytes_per_element * parameters
