"""Core attention: megatron-core's unfused ``DotProductAttention`` against torch's fused
``scaled_dot_product_attention`` (``megatron_streaming/worker/attention.py``), forward and backward
time and memory per sequence length: what ``--attention-backend auto`` rests on.

    .venv/bin/python benchmarks/attention.py                  # CPU: 512 to 4096, fp32 and bf16
    .venv/bin/python benchmarks/attention.py --device cuda    # GPU: 2048, 4096, 8192 in bf16
    .venv/bin/python benchmarks/attention.py --out attention.json --seq 1024 --dtype fp32
    python3 benchmarks/attention.py --flash-check --device cuda --out attention_flash.json

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

``--flash-check`` (one process, bf16, 4096 tokens unless told): SDPA forced to its flash kernel
(``sdpa_kernel(FLASH_ATTENTION)``) against the unfused attention (megatron-core's
``DotProductAttention``, ``--attention-backend unfused``) in three cases, plain causal,
grouped-query (8 groups) and grouped-query with dropout 0.1: the largest absolute difference
of the outputs and of the gradients of q, k and v, each also against an fp32 reference, and
forward and backward times. With dropout the two draw different masks, so the comparison
takes the flash kernel's own mask (its debug mask, ``return_debug_mask``) into the unfused
attention's dropout and into the reference: the same dropped entries, the same result within
rounding; the times are each kernel's with its own draws. A case the device cannot run is
recorded with its error (the CPU has no flash kernel with dropout).
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
    p.add_argument("--flash-check", action="store_true",
                   help="SDPA forced to flash against the unfused attention (see above)")
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


# ---- --flash-check: the flash kernel against the unfused attention ---------------------------

FLASH_CASES = {  # name: (key/value groups or None for one per head, dropout)
    "causal": (None, 0.0),
    "gqa": (8, 0.0),
    "gqa_dropout": (8, 0.1),
}


def _kept_entries(keep, p: float):
    """The unfused attention's dropout given the flash kernel's mask (a module, as the
    attention's own dropout is): the same entries dropped, the kept ones scaled by
    1 / (1 - p) as both kernels do."""
    import torch

    class KeptEntries(torch.nn.Module):
        def forward(self, probs):
            return probs * keep[..., :probs.size(-2), :probs.size(-1)] / (1.0 - p)

    return KeptEntries()


def _flash_keep_mask(q, k, v, p: float, scale: float):
    """The flash kernel's output and its dropout mask (True: kept) for q, k, v in SDPA's
    layout ``[b, heads, s, d]``: the kernel's debug mask holds the probabilities with the
    sign bit set on the dropped ones."""
    import torch

    result = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, p, True, True, scale=scale)
    return result[0], result[-1] >= 0


def _fp32_reference(q, k, v, w, scale: float, keep=None, p: float = 0.0):
    """Output ``[s, b, heads x d]`` and the gradients of q, k, v in fp32, by the formula."""
    import torch

    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    qs, ks, vs = (t.permute(1, 2, 0, 3) for t in leaves)
    repeat = qs.size(1) // ks.size(1)
    ks, vs = ks.repeat_interleave(repeat, dim=1), vs.repeat_interleave(repeat, dim=1)
    scores = (qs @ ks.transpose(-1, -2)) * scale
    s = scores.size(-1)
    causal = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
    if keep is not None:
        probs = _kept_entries(keep, p)(probs)
    out = (probs @ vs).permute(2, 0, 1, 3).reshape(s, qs.size(0), -1)
    out.backward(w.float())
    return out.detach(), [t.grad for t in leaves]


def _error(e: Exception) -> str:
    """An exception as one short line (the dispatcher's lists its backends)."""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"


def _max_abs(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def flash_case(name: str, device: str, seq: int, heads: int, head_dim: int, groups,
               dropout: float, repeats: int) -> dict:
    """One case of ``--flash-check``: differences and times (see the module's docstring)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    groups = groups or heads
    row = {"case": name, "device": device, "seq": seq, "heads": heads, "groups": groups,
           "head_dim": head_dim, "dropout": dropout, "dtype": "bf16"}
    unfused = _modules("unfused", "bf16", heads, groups, head_dim, dropout)
    fused = _modules("sdpa", "bf16", heads, groups, head_dim, dropout)
    gen = torch.Generator().manual_seed(0)

    def tensor(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    q, k, v = tensor(seq, 1, heads, head_dim), tensor(seq, 1, groups, head_dim), \
        tensor(seq, 1, groups, head_dim)
    w = tensor(seq, 1, heads * head_dim)
    scale = fused.softmax_scale

    def run(attend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        out.backward(w)
        return out.detach(), [t.grad for t in leaves]

    def flash_module(*leaves):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return fused(*leaves, None)

    keep = None
    try:
        if dropout:  # the flash kernel's own draw, taken into the unfused attention
            def flash_op(*leaves):
                out, mask = _flash_keep_mask(*(t.permute(1, 2, 0, 3) for t in leaves),
                                             dropout, scale)
                flash_op.keep = mask
                return out.permute(2, 0, 1, 3).reshape(seq, 1, -1)
            flash = run(flash_op)
            keep = flash_op.keep
            own = unfused.attention_dropout
            unfused.attention_dropout = _kept_entries(keep, dropout)
            try:
                plain = run(lambda *t: unfused(*t, None))
            finally:
                unfused.attention_dropout = own
        else:
            flash = run(flash_module)
            plain = run(lambda *t: unfused(*t, None))
        ref = _fp32_reference(q, k, v, w, scale, keep, dropout)
        names = ("out", "dq", "dk", "dv")
        pairs = {"flash_vs_unfused": (flash, plain), "flash_vs_fp32": (flash, ref),
                 "unfused_vs_fp32": (plain, ref)}
        for label, (a, b) in pairs.items():
            row[label] = {n: _max_abs(x, y) for n, x, y in
                          zip(names, [a[0], *a[1]], [b[0], *b[1]])}
        row["fp32_max_abs"] = {n: float(x.abs().max()) for n, x in
                               zip(names, [ref[0], *ref[1]])}
        if keep is not None:
            s = seq
            causal = torch.ones(s, s, dtype=torch.bool, device=keep.device).tril()
            row["flash_kept_fraction"] = float(keep[..., :s, :s][..., causal].float().mean())
    except Exception as e:  # a kernel this device lacks: recorded, the rest still runs
        row["error"] = _error(e)
    row["times_ms"] = {}
    for label, attend in (("flash", flash_module),
                          ("unfused", lambda *t: unfused(*t, None))):
        try:
            row["times_ms"][label] = _times(attend, q, k, v, w, device, repeats)
        except Exception as e:
            row["times_ms"][label] = {"error": _error(e)}
    return row


def _times(attend, q, k, v, w, device: str, repeats: int) -> dict:
    """Median forward and backward ms over ``repeats`` after one warm-up, and the peak MiB
    above what was held before (CUDA only)."""
    import torch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    forward, backward = [], []
    peak = 0.0
    for i in range(repeats + 1):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if i == 1 and device == "cuda":
            held = _memory_now(device)
            _reset_peak(device)
        sync()
        start = time.perf_counter()
        out = attend(*leaves)
        sync()
        middle = time.perf_counter()
        out.backward(w)
        sync()
        if i == 1 and device == "cuda":
            peak = (_peak(device) - held) / 2**20
        if i:
            forward.append(1e3 * (middle - start))
            backward.append(1e3 * (time.perf_counter() - middle))
    return {"forward": statistics.median(forward), "backward": statistics.median(backward),
            "peak_mib": peak}


def flash_check(args) -> dict:
    import torch

    import patches
    from megatron.core import parallel_state

    from megatron_streaming.parallel.distributed import seed_everything

    patches.apply()
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # the unfused scores' buffer
        parallel_state._set_global_memory_buffer()
    seed_everything(1234, tp_rank=0)  # the tracker whose fork both kernels draw in
    seq = (args.seq or [4096])[0]
    heads, head_dim = args.heads or 32, args.head_dim or 128
    rows = []
    for name, (groups, dropout) in FLASH_CASES.items():
        if groups is not None and args.groups:
            groups = args.groups
        rows.append(flash_case(name, args.device, seq, heads, head_dim, groups, dropout,
                               args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    return {"command": " ".join(["benchmarks/attention.py", *sys.argv[1:]]),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "rows": rows}


def flash_table(rows) -> str:
    """Per case: the largest differences (flash against unfused, each against fp32) of the
    output and the gradients, and the times."""
    lines = ["| case | flash - unfused: out, dq, dk, dv | flash - fp32 | unfused - fp32 | "
             "flash fwd / bwd ms | unfused fwd / bwd ms |", "|---|---|---|---|---|---|"]

    def diffs(row, key):
        d = row.get(key)
        return ", ".join(f"{d[n]:.2e}" for n in ("out", "dq", "dk", "dv")) if d else "-"

    def times(row, key):
        t = row["times_ms"].get(key, {})
        return f"{t['forward']:.2f} / {t['backward']:.2f}" if "forward" in t else \
            t.get("error", "-")

    for r in rows:
        lines.append(f"| {r['case']} | {diffs(r, 'flash_vs_unfused')} | "
                     f"{diffs(r, 'flash_vs_fp32')} | {diffs(r, 'unfused_vs_fp32')} | "
                     f"{times(r, 'flash')} | {times(r, 'unfused')} |")
        if "error" in r:
            lines.append(f"| {r['case']}: {r['error']} ||||||")
    return "\n".join(lines)


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
    if args.flash_check:
        result = flash_check(args)
        out = args.out or f"attention_flash_{args.device}.json"
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(flash_table(result["rows"]))
        print(f"written: {out}")
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
