"""Core attention: megatron-core's unfused ``DotProductAttention`` against torch's fused
``scaled_dot_product_attention`` (``megatron_streaming/worker/attention.py``), forward and backward
time and memory per sequence length: what ``--attention-backend auto`` rests on.

    .venv/bin/python benchmarks/attention.py                  # CPU: 512 to 4096, fp32 and bf16
    .venv/bin/python benchmarks/attention.py --device cuda    # GPU: 2048, 4096, 8192 in bf16
    .venv/bin/python benchmarks/attention.py --out attention.json --seq 1024 --dtype fp32

Writes a JSON (``--out``, default ``attention_<device>.json``) and prints a table. Each
configuration runs in a process of its own (the CPU's peak is a process's high-water mark,
and an allocator that kept an earlier configuration's memory would hide the next one's).

Kinds: ``unfused`` (megatron-core's), ``sdpa`` (the fused one as training runs it: causal by
the mask type, no mask; the loader makes none for it) and ``sdpa+mask`` (the fused one given
the loader's explicit ``[s, s]`` causal mask: the masked kernel path). One layer's core
attention as the layer calls it: q, k, v ``[s, b, heads, d]`` needing gradients, dropout 0
unless ``--attention-dropout``;
the backward of a fixed random projection of the context. Times: medians over ``--repeats``
after one warm-up, forward and backward apart. Memory: ``saved``, the bytes autograd keeps
from the forward for the backward (unique storages other than q, k, v: exact, the same on any
device); ``peak``, the most held at once during one forward and backward beyond what was held
before (CPU: the growth of the process's VmHWM, reset through /proc/self/clear_refs; CUDA:
``max_memory_allocated``).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KINDS = ("unfused", "sdpa", "sdpa+mask")
DEFAULTS = {  # device: (sequence lengths, dtypes, heads, head size)
    "cpu": ([512, 1024, 2048, 4096], ["fp32", "bf16"], 8, 64),
    "cuda": ([2048, 4096, 8192], ["bf16"], 32, 128),
}


def _parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=sorted(DEFAULTS), default="cpu")
    p.add_argument("--seq", type=int, nargs="+", help="sequence lengths (default per device)")
    p.add_argument("--dtype", nargs="+", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--heads", type=int, help="query heads of the layer (on this rank)")
    p.add_argument("--groups", type=int, help="key/value groups (default: one per head)")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--attention-dropout", type=float, default=0.0,
                   help="dropout on the probabilities (torch has no fused CPU kernel for it)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="JSON path (default attention_<device>.json)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # one configuration, in a child process
    return p


# ---- one configuration (child process) ----------------------------------------------------

def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _memory_now(device) -> int:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return _status_bytes("VmRSS")


def _reset_peak(device) -> None:
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM back to VmRSS
        f.write("5")


def _peak(device) -> int:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _status_bytes("VmHWM")


def _modules(kind: str, dtype: str, heads: int, groups: int, head_dim: int, dropout: float):
    from types import SimpleNamespace

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_streaming.worker.attention import SDPAttention
    from megatron_streaming.config import ModelConfig, ParallelConfig, PrecisionConfig
    from megatron_streaming.worker.model import transformer_config

    cfg = ModelConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                      group_query_attention=groups != heads, num_query_groups=groups,
                      attention_dropout=dropout, transformer_impl="local")
    config = transformer_config(cfg, ParallelConfig(),
                                precision=PrecisionConfig(bf16=dtype == "bf16",
                                                          fp16=dtype == "fp16"))
    one_rank = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    cls = DotProductAttention if kind == "unfused" else SDPAttention
    return cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
               attention_type="self", pg_collection=one_rank)


def _measure(spec: dict) -> dict:
    import torch

    import patches
    from megatron.core import parallel_state

    from megatron_streaming.parallel.distributed import seed_everything

    patches.apply()
    device, kind = spec["device"], spec["kind"]
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # the unfused scores' buffer
        parallel_state._set_global_memory_buffer()
    seed_everything(1234, tp_rank=0)  # megatron-core forks the tracker's stream even at p = 0
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec["dtype"]]
    s, b, h, g, d = spec["seq"], spec["batch"], spec["heads"], spec["groups"], spec["head_dim"]
    attention = _modules(kind, spec["dtype"], h, g, d, spec["dropout"])
    gen = torch.Generator().manual_seed(0)

    def tensor(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def inputs(seq):
        q, k, v = tensor(seq, b, h, d), tensor(seq, b, g, d), tensor(seq, b, g, d)
        mask = None
        if kind == "sdpa+mask":
            mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
            mask = mask.view(1, 1, seq, seq)
        return [t.requires_grad_() for t in (q, k, v)], mask, tensor(seq, b, h * d)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def step(leaves, mask, w, saved=None):
        sync()
        start = time.perf_counter()
        if saved is None:
            out = attention(*leaves, mask)
        else:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x):
                out = attention(*leaves, mask)
        sync()
        middle = time.perf_counter()
        out.backward(w)
        sync()
        return middle - start, time.perf_counter() - middle

    step(*inputs(64))  # lazy initialisation (threads, kernels) out of the peak
    leaves, mask, w = inputs(s)
    saved = _Saved({t.untyped_storage().data_ptr() for t in leaves})
    held = _memory_now(device)
    _reset_peak(device)
    step(leaves, mask, w, saved)
    peak = _peak(device) - held
    forward, backward = [], []
    for _ in range(spec["repeats"]):
        for t in leaves:
            t.grad = None
        f, bw = step(leaves, mask, w)
        forward.append(f)
        backward.append(bw)
    return {**spec, "forward_ms": 1e3 * statistics.median(forward),
            "backward_ms": 1e3 * statistics.median(backward),
            "saved_mib": saved.bytes / 2**20, "peak_mib": max(peak, 0) / 2**20,
            "threads": torch.get_num_threads(), "torch": torch.__version__}


class _Saved:
    """Bytes of the unique storages autograd saves, the inputs left out."""

    def __init__(self, skip):
        self.seen, self.bytes = set(skip), 0

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key not in self.seen:
            self.seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        return t


# ---- the sweep (parent process) -------------------------------------------------------------

def _run_one(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", json.dumps(spec)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {**spec, "error": proc.stderr.strip().splitlines()[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(rows) -> str:
    """Per length and dtype: each kind's forward / backward ms and saved / peak MiB, and the
    unfused-to-fused ratios."""
    lines = ["| seq | dtype | kind | forward ms | backward ms | saved MiB | peak MiB | "
             "fwd+bwd vs sdpa | peak vs sdpa |", "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["seq"], r["dtype"], r["kind"]): r for r in rows}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['seq']} | {r['dtype']} | {r['kind']} | {r['error']} |||||")
            continue
        base = by.get((r["seq"], r["dtype"], "sdpa"), {})
        total = r["forward_ms"] + r["backward_ms"]
        ratio = total / (base["forward_ms"] + base["backward_ms"]) if "forward_ms" in base \
            else float("nan")
        peak = r["peak_mib"] / base["peak_mib"] if base.get("peak_mib") else float("nan")
        lines.append(f"| {r['seq']} | {r['dtype']} | {r['kind']} | {r['forward_ms']:.1f} | "
                     f"{r['backward_ms']:.1f} | {r['saved_mib']:.1f} | {r['peak_mib']:.1f} | "
                     f"{ratio:.2f} | {peak:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.one:
        print(json.dumps(_measure(json.loads(args.one))))
        return 0
    seqs, dtypes, heads, head_dim = DEFAULTS[args.device]
    heads = args.heads or heads
    base = {"device": args.device, "batch": args.batch, "heads": heads,
            "groups": args.groups or heads, "head_dim": args.head_dim or head_dim,
            "repeats": args.repeats, "dropout": args.attention_dropout}
    rows = []
    for dtype in args.dtype or dtypes:
        for seq in args.seq or seqs:
            for kind in KINDS:
                rows.append(_run_one({**base, "seq": seq, "dtype": dtype, "kind": kind}))
                print(json.dumps(rows[-1]), flush=True)
    out = args.out or f"attention_{args.device}.json"
    with open(out, "w") as f:
        json.dump({"command": " ".join(["benchmarks/attention.py", *(argv or sys.argv[1:])]),
                   "rows": rows}, f, indent=1)
    print(table(rows))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
