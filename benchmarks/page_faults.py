"""How fast a process touches memory it has just allocated: 1 GiB fp32 tensors, allocated and
filled one after another (each page's first touch is a page fault), six while holding them,
then six again after freeing them. On a machine whose free memory the page cache has filled
(checkpoints just written), each fault first reclaims cache; drop the cache first
(``sync; echo 1 > /proc/sys/vm/drop_caches``, as root) to see the difference.

    .venv/bin/python benchmarks/page_faults.py
"""

import time

import torch


def touch(count: int) -> list:
    rates, held = [], []
    for _ in range(count):
        started = time.perf_counter()
        x = torch.empty(1 << 28, dtype=torch.float32)
        x.fill_(1.0)
        rates.append(round(1.0 / (time.perf_counter() - started), 2))  # GiB/s
        held.append(x)
    return rates


def main():
    torch.set_num_threads(1)
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    print("MemFree", info["MemFree"].strip(), "Cached", info["Cached"].strip())
    print("first pass, GiB/s per GiB:", touch(6))
    print("again, GiB/s per GiB:", touch(6))


if __name__ == "__main__":
    main()
