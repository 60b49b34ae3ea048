"""``python -m megatron_streaming.plan``: a plan for a cross-cluster job, and its sbatch lines.

    python -m megatron_streaming.plan \\
        --cluster launch/clusters/h100_64.yaml --cluster launch/clusters/a100_32.yaml \\
        --link launch/clusters/link_10g_80ms.yaml --rendezvous login01.example:29500 \\
        --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \\
        --global-batch-size 512 --train-iters 20000 --bf16 --tokenizer-model ... [--explain]

Every flag that is not the planner's is ``pretrain_gpt.py``'s (the model, the data, the
run): the plan reads the model from them and repeats them in the sbatch lines, with the
layout, the per-worker batch and the sync flags it chose in place of any given.
"""

from __future__ import annotations

import argparse
import sys
from typing import List

from ..errors import first_line

# pretrain_gpt.py flags the plan sets (value-taking unless listed in _SWITCHES).
_PLANNED = {"--tensor-model-parallel-size", "--pipeline-model-parallel-size",
            "--ds-sequence-parallel-size", "--zero-stage", "--micro-batch-size",
            "--global-batch-size", "--recompute-granularity", "--recompute-method",
            "--recompute-num-layers", "--diloco-workers", "--diloco-worker-index",
            "--diloco-inner-steps", "--diloco-fragments", "--diloco-overlap-steps",
            "--diloco-outer-lr", "--diloco-outer-momentum", "--diloco-alpha",
            "--diloco-quantize", "--diloco-control-lag", "--diloco-eager", "--master-addr",
            "--master-port", "--rendezvous-external"}
_SWITCHES = {"--diloco-eager", "--rendezvous-external"}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m megatron_streaming.plan",
        description="Plan a cross-cluster Streaming DiLoCo job: a layout per cluster, the "
        "batches and the sync settings, with sbatch lines. Other flags are pretrain_gpt.py's.")
    ap.add_argument("--cluster", action="append", required=True, metavar="FILE",
                    help="A cluster description (YAML or JSON), one per cluster; a cluster "
                    "runs one worker or several of the same size (workers are numbered "
                    "cluster by cluster, in this order); launch/clusters/ has examples.")
    ap.add_argument("--max-workers", type=int, default=8,
                    help="The most DiLoCo workers the clusters may be cut into.")
    ap.add_argument("--link", required=True, metavar="FILE",
                    help="The inter-cluster link (bandwidth_gbit_per_s, rtt_ms).")
    ap.add_argument("--rendezvous", default="RENDEZVOUS_HOST:29500", metavar="HOST:PORT",
                    help="Where launch/rendezvous.sh will serve the job's rendezvous.")
    ap.add_argument("--memory-headroom", type=float, default=0.1,
                    help="Fraction of each device's memory the plan leaves free.")
    ap.add_argument("--link-share", type=float, default=0.5,
                    help="Fraction of the link's bandwidth the sync may use on average: sets "
                    "the smallest H (smaller H, lower loss; more traffic).")
    ap.add_argument("--explain", action="store_true",
                    help="Show each cluster's top candidates and why each lost.")
    return ap


def _without_planned(argv: List[str]) -> List[str]:
    out, skip = [], False
    for i, token in enumerate(argv):
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in _PLANNED:
            skip = "=" not in token and name not in _SWITCHES
            continue
        out.append(token)
    return out


def launcher_check(cfg, workers: int):
    """Why pretrain_gpt.py would refuse ``cfg`` with a layout and a batch (its own
    ``validate``), or None: so the plan only proposes what the launch accepts."""
    import copy

    from ..cli.arguments import validate
    from ..errors import UsageError

    def check(layout, batch: int):
        c = copy.deepcopy(cfg)
        p, t, m = c.parallel, c.training, c.model
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size = layout.tp, layout.pp
        p.ds_sequence_parallel_size, p.zero_stage = layout.sp, layout.zero_stage
        t.micro_batch_size, t.global_batch_size = layout.micro_batch, batch
        m.recompute_granularity = None if layout.recompute == "none" else layout.recompute
        m.recompute_method = "uniform" if layout.recompute == "full" else None
        try:
            validate(c, layout.ranks * workers)
        except UsageError as e:
            return first_line(e)
        return None

    return check


def attention_kernel(cfg) -> str:
    """``unfused`` where the core attention keeps its scores (``--attention-backend unfused``
    or ``local``: megatron-core's, or Transformer Engine's unfused one); else ``flash``:
    Transformer Engine's fused kernels on its layers, torch's fused attention on the local
    ones (Ulysses and Ladder included), which ``auto`` runs there."""
    from ..worker.model import local_attention

    return "unfused" if local_attention(cfg.model.attention_backend) == "unfused" else "flash"


def main(argv=None) -> int:
    from ..cli.arguments import parse_args
    from ..errors import UsageError
    from ..data.inputs import load_run_tokenizer
    from .clusters import load_cluster, load_link
    from .memory import ModelShape, Training
    from .report import format_plan
    from .search import plan
    from .wire import Wire

    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = _parser().parse_known_args(argv)
    try:
        clusters = [load_cluster(p) for p in args.cluster]
        link = load_link(args.link)
        cfg = parse_args([*rest, "--diloco-workers", str(len(clusters))])
        vocab = load_run_tokenizer(cfg).vocab_size
        shape = ModelShape.from_config(cfg.model, vocab)
        precision = "bf16" if cfg.precision.bf16 else "fp16" if cfg.precision.fp16 else "fp32"
        s = cfg.streaming
        wire = Wire.from_streaming(s)  # the run's --diloco-quantize sparse, else FP4
        training = Training(precision, cfg.training.global_batch_size, True,
                            error_feedback=s.diloco_error_feedback or wire.sparse,
                            offload_outer_state=s.diloco_offload_outer_state,
                            attention=attention_kernel(cfg),
                            overlap_comm=cfg.parallel.overlap_grad_reduce,
                            grad_reduce_in_bf16=cfg.precision.grad_reduce_in_bf16,
                            save=bool(cfg.checkpoint.save),
                            async_save=cfg.checkpoint.async_save)
        result = plan(shape, clusters, link, cfg.training.global_batch_size,
                      cfg.training.train_iters, training, args.memory_headroom,
                      launcher_check(cfg, len(clusters)), args.link_share, args.max_workers,
                      wire)
    except UsageError as e:
        for line in str(e).splitlines():
            print(f"plan: error: {line}", file=sys.stderr)
        return 2
    print(format_plan(result, shape, link, _without_planned(rest), args.rendezvous,
                      args.explain))
    return 0


if __name__ == "__main__":
    sys.exit(main())
