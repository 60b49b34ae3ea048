"""What a checkpoint file's hash costs while it is written: torch.save of 2.4 GB of fp32
tensors (120 of 20 MB) into one file, fsync'd, from two processes at once (two ranks of a
node), with torch's per-record CRC-32 (the default), without it, and without it but hashing
the bytes as they pass with XXH3-128 or SHA-256 (what ``patches/megatron_checkpoint_writer``
does). Each setting three times, in turn; the seconds of the slower process each time.

    .venv/bin/python benchmarks/checkpoint_hash.py [--dir /tmp] [--repeat 3]
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

MODES = ("torch_crc32", "none", "xxh3_128", "sha256")


def write_once(mode: str, path: str) -> float:
    import torch
    import xxhash

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from patches.megatron_checkpoint_writer import _Hashed  # what a save writes through

    x = torch.randn(600_000_000)
    parts = [torch.from_numpy(x[i * 5_000_000:(i + 1) * 5_000_000].numpy()) for i in range(120)]
    torch.serialization.set_crc32_options(mode == "torch_crc32")
    hashes = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
    started = time.perf_counter()
    with open(path, "wb") as f:
        stream = _Hashed(f, hashes[mode]()) if mode in hashes else f
        for p in parts:
            torch.save(p, stream)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    os.remove(path)
    return seconds


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(write_once(sys.argv[2], sys.argv[3]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    results = {m: [] for m in MODES}
    for _ in range(args.repeat):
        for mode in MODES:
            procs = [subprocess.Popen([sys.executable, __file__, "--one", mode,
                                       os.path.join(args.dir, f"hash_bench_{i}.bin")],
                                      stdout=subprocess.PIPE, text=True, env=env)
                     for i in range(2)]
            results[mode].append(max(float(p.communicate()[0]) for p in procs))
    summary = {m: {"seconds": v, "mean": sum(v) / len(v)} for m, v in results.items()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
