"""What our training step costs over a bare megatron-core training step of the same job.

    .venv/bin/python benchmarks/overhead.py --lock /tmp/cpu.lock --out runs/overhead
    .venv/bin/python benchmarks/overhead.py --lock /tmp/cpu.lock --dp 1 --allocators default \
        --repeats 3                       # the run-to-run spread of the default allocator

Evidence for "bring your own job": moving a megatron-core job onto ``pretrain_gpt.py`` should
cost almost nothing per step. Each configuration (data-parallel size x allocator setting) is
one torchrun launch, ``--lock`` held around it; in every rank both loops are built side by
side and timed step by step in alternating order (bare then ours on even steps, ours then bare
on odd ones), after untimed warm-up steps, on the same micro-batches (random token ids of a
fixed seed, with the causal mask our data loader makes), so machine drift and the data
pipeline favour neither. The figure is ours / bare: the ratio of the median step times, and
the median and inter-quartile range of the per-step ratios; with DP=2 each rank measures its
own and the mean over ranks is reported. Each step is also split into its update (bare:
all-reduce + clipping + AdamW; ours: DeepSpeed's ``engine.step``) and the rest, and the
process's minor page faults are counted per step.

* Bare: megatron-core's public API and torch only. ``parallel_state.initialize_model_parallel``
  on the gloo world, ``model_parallel_cuda_manual_seed``, ``GPTModel`` with
  ``get_gpt_layer_local_spec`` and a ``TransformerConfig`` written out field by field,
  ``get_forward_backward_func``'s schedule with a forward step and loss function, then (DP>1)
  one all-reduce of the flattened gradients, ``clip_grad_norm_`` to ``--clip-grad`` and
  ``torch.optim.AdamW`` (no weight decay on biases and norm weights, as Megatron), constant lr.
  megatron-core cannot run on CPU without the run-time fixes of our ``patches`` package, so
  ``patches.apply()`` runs first (it only swaps CUDA-only allocations and RNG calls).
* Ours: ``megatron_streaming.run.train.Run`` built from ``parse_args`` of the same flags, as
  ``pretrain_gpt.py`` builds it (DeepSpeed ZeRO-1 over the DP ranks, the default), timed as
  the training loop runs it: ``run.engine.train_step`` plus the per-step stop-flag agreement.
  A progress report (``--log-interval``, default 1) is timed on its own.
* Allocators: glibc hands freed blocks above a moving size threshold back to the system, so a
  later allocation maps and zero-fills fresh pages; how often depends on the whole history of
  the process's allocations, and on CPU that costs up to ~10 % of a step here, for either
  loop. ``default`` leaves glibc as it is; ``keep`` fixes its thresholds
  (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) so freed memory is reused, which
  isolates the cost of the step itself (on a GPU the caching allocator does this anyway).

Both loops live in one process per rank: the bare model is built first, on megatron's own
``parallel_state`` groups; ``Run.setup`` then points ``parallel_state`` at its own groups of
the same ranks (``Topology.install_into_megatron``), which the bare schedule and loss then
read. The bare model starts from our model's initial weights and dropout is off, so the two
loops compute the same numbers: their losses are compared step by step, as evidence that the
same work is timed. Writes ``overhead.json`` under ``--out``.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# About 0.8 s per step on one core: 2.4M parameters, 2 micro-batches of 4 x 256 tokens.
# megatron-core's unfused attention in ours too: the bare loop's local spec runs it.
MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads",
         "8", "--seq-length", "256", "--micro-batch-size", "4", "--eval-iters", "0",
         "--lr-decay-style", "constant", "--lr", "3e-4", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--clip-grad", "1.0", "--weight-decay", "0.01",
         "--attention-backend", "unfused"]
MICRO_BATCHES = 2  # per rank and step, for both loops
DISTINCT_BATCHES = 16  # micro-batches cycled through (the same ones for both loops)


# ---- the bare megatron-core loop ------------------------------------------------------------
def bare_transformer_config(cfg):
    """Our flags' model, written against megatron-core's TransformerConfig directly (checked
    against ours field by field in ``config_differences``)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = cfg.model
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, ffn_hidden_size=4 * m.hidden_size,
        activation_func=F.gelu, normalization="LayerNorm", layernorm_epsilon=m.norm_epsilon,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False)


def config_differences(ours, bare) -> list:
    """Fields of the two TransformerConfigs that differ (functions compared by name: the
    init methods are closures made per instance)."""
    import dataclasses

    def comparable(value):
        return getattr(value, "__qualname__", value) if callable(value) else value

    out = []
    for f in dataclasses.fields(ours):
        a, b = comparable(getattr(ours, f.name)), comparable(getattr(bare, f.name))
        if repr(a) != repr(b):
            out.append(f"{f.name}: ours {a!r}, bare {b!r}")
    return out


def bare_loss(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = (losses * mask).sum() / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def bare_forward_step(data_iterator, model):
    from functools import partial

    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(bare_loss, batch["loss_mask"])


class BareStep:
    """A megatron-core training step as a user would write it without our library."""

    def __init__(self, cfg, vocab_size: int):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.cfg = cfg
        self.model = GPTModel(config=bare_transformer_config(cfg),
                              transformer_layer_spec=get_gpt_layer_local_spec(),
                              vocab_size=vocab_size, max_sequence_length=cfg.model.seq_length,
                              share_embeddings_and_output_weights=True)
        self.forward_backward = get_forward_backward_func()
        self.optimizer = None  # made by ``start``, once the weights are final

    def start(self) -> None:
        import torch

        o = self.cfg.optimizer
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
        self.params = decay + no_decay
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)

    def __call__(self, batches: list) -> tuple:
        import torch
        import torch.distributed as dist

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        outputs = self.forward_backward(
            forward_step_func=bare_forward_step, data_iterator=iter(batches), model=self.model,
            num_microbatches=len(batches), seq_length=self.cfg.model.seq_length,
            micro_batch_size=self.cfg.training.micro_batch_size, forward_only=False)
        update_started = time.perf_counter()
        world = dist.get_world_size()
        if world > 1:  # plain data parallel: one bucket, averaged, after the backward
            grads = [p.grad for p in self.params]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            flat /= world
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optimizer.clip_grad)
        self.optimizer.step()
        self.update_s = time.perf_counter() - update_started
        loss = torch.stack([o["lm loss"] for o in outputs]).mean().double()
        dist.all_reduce(loss)
        return float(loss) / world, float(norm)


def start_bare(cfg, vocab_size: int) -> BareStep:
    """megatron-core's state, the minimal way on a CPU world of gloo ranks."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    import patches

    patches.apply()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(cfg.training.seed)
    model_parallel_cuda_manual_seed(cfg.training.seed)
    return BareStep(cfg, vocab_size)


# ---- the measurement (runs inside each torchrun rank) ---------------------------------------
def make_batches(cfg, vocab_size: int, rank: int) -> list:
    """Micro-batches shaped as our data loader yields them (tokens, labels, loss mask,
    positions, one [1, 1, s, s] causal mask, True = masked)."""
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    b, s = cfg.training.micro_batch_size, cfg.model.seq_length
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    out = []
    for _ in range(DISTINCT_BATCHES):
        ids = torch.randint(0, vocab_size, (b, s + 1), generator=gen)
        out.append({"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
                    "loss_mask": torch.ones(b, s), "attention_mask": mask,
                    "position_ids": torch.arange(s).expand(b, s).contiguous()})
    return out


def ours_step(run, batches: list) -> tuple:
    """One iteration of ``Run.train``'s loop, without the progress report."""
    started = time.perf_counter()
    result = run.engine.train_step(iter(batches), run.iteration)
    step_s = time.perf_counter() - started
    run.step_seconds.append(step_s)
    run.iteration += 1
    run.liveness.iteration = run.iteration
    run.stop.should_stop()
    return result, step_s


class UpdateTimer:
    """Times DeepSpeed's ``engine.step`` (ZeRO's gradient reduction, norm, clipping, AdamW on
    the fp32 partition, copy back into the model): the counterpart of the bare loop's
    all-reduce + ``clip_grad_norm_`` + ``AdamW.step``."""

    def __init__(self, ds_engine):
        self.seconds = 0.0
        step = ds_engine.step

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                self.seconds = time.perf_counter() - started
        ds_engine.step = timed


def minor_faults() -> int:
    """Page faults of this process so far: each one maps a fresh page (allocator refills)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def one_step(which: str, bare, run, update_timer, batches) -> dict:
    faults, started = minor_faults(), time.perf_counter()
    if which == "bare":
        loss, _ = bare(batches)
        update_s, step_s = bare.update_s, None
    else:
        result, step_s = ours_step(run, batches)
        loss, update_s = result.loss, update_timer.seconds
    return {"s": time.perf_counter() - started, "update_s": update_s, "step_s": step_s,
            "faults": minor_faults() - faults, "loss": loss}


def build_both(argv: list, ours_flags: list) -> tuple:
    """The bare loop from ``argv``'s model and optimizer settings; ours from ``argv`` plus
    ``ours_flags`` (settings the bare loop has no counterpart for, e.g. ``--zero-stage``)."""
    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.config.shape import padded_vocab_size
    from megatron_streaming.run.train import Run

    cfg = parse_args(argv)
    vocab = padded_vocab_size(cfg.data.vocab_size or 256, cfg.model.make_vocab_size_divisible_by, 1)
    bare = start_bare(cfg, vocab)
    run = Run(parse_args([*argv, *ours_flags])).setup()
    differences = config_differences(run.model.config, bare.model.config)
    bare.model.load_state_dict(run.model.state_dict())
    bare.start()
    return cfg, vocab, bare, run, differences


def measure_rank(opts, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from megatron_streaming.run.metrics import Throughput

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    total = opts.warmup + opts.steps
    argv = [*MODEL, "--global-batch-size", str(world * MICRO_BATCHES * 4),
            "--train-iters", str(total)]
    cfg, vocab, bare, run, differences = build_both(argv, shlex.split(opts.ours_flags))
    update_timer = UpdateTimer(run.engine.engine)
    pool = make_batches(cfg, vocab, dist.get_rank())
    samples = {"bare": [], "ours": []}
    for i in range(total):
        batches = [pool[(i * MICRO_BATCHES + k) % len(pool)] for k in range(MICRO_BATCHES)]
        for which in (("bare", "ours") if i % 2 == 0 else ("ours", "bare")):
            sample = one_step(which, bare, run, update_timer, batches)
            if i >= opts.warmup:
                samples[which].append(sample)
    # A progress report as --log-interval 1 makes after every step (rank 0 prints it).
    throughput, report_s = Throughput(run.data.tokens_through, 0), []
    result = run.engine.train_step(iter(batches), run.iteration)
    for _ in range(5):
        started = time.perf_counter()
        run.report.log_step(run.iteration, result, throughput, run.data, run.writer,
                            run.step_seconds[-1])
        report_s.append(time.perf_counter() - started)
    run.stop.close()
    record = {k: {which: [s[k] for s in samples[which]] for which in samples}
              for k in ("s", "update_s", "faults", "loss")}
    record.update(ours_train_step_s=[s["step_s"] for s in samples["ours"]],
                  report_s=report_s, config_differences=differences,
                  parameters=run.report.parameter_count())
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    run.liveness.close()
    run.topology.cross.job_barrier()


# ---- the launcher and the summary -----------------------------------------------------------
# "keep": blocks up to 32 MB come from the heap and the heap is never trimmed (module docstring).
ALLOCATORS = {"default": {},
              "keep": {"MALLOC_MMAP_THRESHOLD_": str(32 << 20),
                       "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}}


def quartiles(values: list) -> list:
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def summarise_rank(r: dict) -> dict:
    from micro import bootstrap_ratio

    bare, ours = r["s"]["bare"], r["s"]["ours"]
    paired = [o / b for o, b in zip(ours, bare)]
    step_only = [o / b for o, b in zip(r["ours_train_step_s"], bare)]
    gaps = [abs(a - b) / abs(b) for a, b in zip(r["loss"]["ours"], r["loss"]["bare"])]
    median = {k: statistics.median(v) for k, v in r["s"].items()}
    update = {k: statistics.median(v) for k, v in r["update_s"].items()}
    return {
        "median_bare_s": median["bare"], "median_ours_s": median["ours"],
        "ratio_of_medians": median["ours"] / median["bare"],
        "ratio_of_medians_95ci": bootstrap_ratio(ours, bare),
        "paired_ratio_median": statistics.median(paired),
        "paired_ratio_iqr": quartiles(paired),
        "train_step_only_ratio_median": statistics.median(step_only),
        # Where the difference sits: the update (bare: all-reduce + clip + AdamW; ours:
        # DeepSpeed's engine.step) and the rest (forward and backward of the same model).
        "median_update_bare_s": update["bare"], "median_update_ours_s": update["ours"],
        "update_difference_of_bare_step": (update["ours"] - update["bare"]) / median["bare"],
        "rest_difference_of_bare_step":
            (median["ours"] - update["ours"] - median["bare"] + update["bare"]) / median["bare"],
        "median_page_faults_bare": statistics.median(r["faults"]["bare"]),
        "median_page_faults_ours": statistics.median(r["faults"]["ours"]),
        "report_s_median": statistics.median(r["report_s"]),
        "report_fraction_of_bare_step": statistics.median(r["report_s"]) / median["bare"],
        "max_relative_loss_difference": max(gaps), "steps_each": len(bare),
        "config_differences": r["config_differences"],
    }


def measure(dp: int, allocator: str, opts, out: Path) -> dict:
    for f in out.glob("rank*.json"):
        f.unlink()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(dp), __file__, "--rank", "--steps", str(opts.steps), "--warmup",
           str(opts.warmup), "--out", str(out), "--ours-flags", opts.ours_flags]
    log = out / f"dp{dp}_{allocator}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", **ALLOCATORS[allocator])
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=f,
                              stderr=subprocess.STDOUT).returncode
    if code:
        raise RuntimeError(f"DP={dp}, {allocator} allocator: the ranks exited with {code}; "
                           f"see {log}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(dp)]
    per_rank = [summarise_rank(r) for r in ranks]
    numeric = [k for k, v in per_rank[0].items() if isinstance(v, (int, float))]
    return {"dp": dp, "allocator": allocator, "allocator_env": ALLOCATORS[allocator],
            "per_rank": per_rank, "parameters": ranks[0]["parameters"],
            "mean_over_ranks": {k: statistics.mean(p[k] for p in per_rank) for k in numeric},
            "raw": [{k: r[k] for k in ("s", "update_s", "faults", "ours_train_step_s")}
                    for r in ranks]}


def print_result(r: dict) -> None:
    m = r["mean_over_ranks"]
    iqr = ", ".join(f"{p['paired_ratio_iqr'][0]:.3f}-{p['paired_ratio_iqr'][1]:.3f}"
                    for p in r["per_rank"])
    print(f"DP={r['dp']}, {r['allocator']} allocator: median step bare "
          f"{m['median_bare_s'] * 1e3:.1f} ms, ours {m['median_ours_s'] * 1e3:.1f} ms; ours/bare "
          f"{m['ratio_of_medians']:.4f} (per-step ratios: median {m['paired_ratio_median']:.4f}"
          f", IQR {iqr}); update {m['median_update_bare_s'] * 1e3:.1f} vs "
          f"{m['median_update_ours_s'] * 1e3:.1f} ms "
          f"({100 * m['update_difference_of_bare_step']:+.2f} %), rest {100 * m['rest_difference_of_bare_step']:+.2f} %; page faults/step "
          f"{m['median_page_faults_bare']:.0f} vs {m['median_page_faults_ours']:.0f}; progress "
          f"report {m['report_s_median'] * 1e3:.2f} ms; losses within "
          f"{m['max_relative_loss_difference']:.1e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", default="1,2", help="data-parallel sizes, comma-separated")
    ap.add_argument("--allocators", default="default,keep", help=f"of {list(ALLOCATORS)}")
    ap.add_argument("--steps", type=int, default=40, help="timed steps of each loop")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--ours-flags", default="",
                    help="extra pretrain_gpt.py flags for our loop only, e.g. '--zero-stage 0'")
    ap.add_argument("--repeats", type=int, default=1, help="launches of each configuration")
    ap.add_argument("--lock", default=None,
                    help="flock this file around each launch (e.g. /tmp/cpu.lock)")
    ap.add_argument("--out", default=str(REPO / "runs" / "overhead"))
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    if opts.rank:
        return measure_rank(opts, out)
    from micro import git_state

    from slow_link import bench_lock

    began = time.perf_counter()
    results = []
    for repeat in range(opts.repeats):
        for dp in (int(d) for d in opts.dp.split(",")):
            for allocator in opts.allocators.split(","):
                with bench_lock(opts.lock):  # one launch at a time; others take turns
                    r = measure(dp, allocator, opts, out)
                results.append(dict(r, repeat=repeat))
                print_result(r)
    record = {"commit": git_state(), "flags": MODEL, "micro_batches": MICRO_BATCHES,
              "steps": opts.steps, "warmup": opts.warmup, "threads_per_rank": 1,
              "repeats": opts.repeats, "ours_flags": opts.ours_flags,
              "results": results, "wall_s": time.perf_counter() - began}
    (out / "overhead.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out / 'overhead.json'}")


if __name__ == "__main__":
    sys.exit(main())
