"""Streaming DiLoCo in one process, in plain torch: the reference for the distributed code.

    python tests/diloco_reference.py OUT flags...      (the flags of pretrain_gpt.py)

M simulated workers, each a full single-process copy of the same initial GPT, each trained on
exactly the samples its ranks read in the distributed run, with torch's own AdamW (or SGD) and
gradient clipping. The outer step is torch's SGD with Nesterov momentum on the global copy.
Nothing of the library's sync, transport or codec is used, so a bug there cannot hide in both.
Writes OUT/reference.pt: per worker the local parameters, and the global parameters.
"""

import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import patches  # noqa: E402
from megatron_streaming import distributed, weights  # noqa: E402
from megatron_streaming.arguments import parse_args  # noqa: E402
from megatron_streaming.config import ParallelConfig  # noqa: E402
from megatron_streaming.data import MicroBatchSampler, build_iterator  # noqa: E402
from megatron_streaming.engine import lr_at, num_microbatches  # noqa: E402
from megatron_streaming.inputs import RunData, load_run_tokenizer  # noqa: E402
from megatron_streaming.model import build_model  # noqa: E402
from megatron_streaming.streaming.builder import fragment_plan, sync_schedule  # noqa: E402
from megatron_streaming.topology import RankLayout, Topology  # noqa: E402


def single_process_models(cfg, tokenizer, count):
    """``count`` identical copies of the initial model (modules holding process groups cannot
    be deep-copied; the layout-free initialisation makes fresh builds identical)."""
    distributed.init_distributed("gloo", 5)
    topo = Topology.create(RankLayout(1), 0)
    topo.install_into_megatron()
    return [_build(cfg, tokenizer, topo) for _ in range(count)]


def _build(cfg, tokenizer, topo):
    distributed.seed_everything(cfg.training.seed, 0)
    model = build_model(cfg.model, ParallelConfig(), topo, tokenizer.vocab_size)
    weights.initialize_weights(model, seed=cfg.training.seed, std=cfg.model.init_method_std,
                               num_layers=cfg.model.num_layers, layer_offset=0, tp_rank=0,
                               tp_size=1, gated_mlp=cfg.model.swiglu,
                               zero_centered_norms=cfg.model.apply_layernorm_1p)
    return model


def worker_iterators(cfg, tokenizer, M, DP):
    """iterators[w][d]: what data-parallel rank d of worker w reads in the distributed run."""
    layout = RankLayout(M * DP, M)
    stub = SimpleNamespace(layout=layout, data_shard=(0, M * DP), dp_rank=0)
    data = RunData(cfg, stub, tokenizer)
    return [[build_iterator(data.train, MicroBatchSampler(
        len(data.train), 0, cfg.training.micro_batch_size, w * DP + d, M * DP))
        for d in range(DP)] for w in range(M)]


def inner_optimizer(cfg, model):
    o = cfg.optimizer
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and not n.endswith(".bias")]
    rest = [p for n, p in model.named_parameters() if not (p.ndim > 1 and not n.endswith(".bias"))]
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    if o.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.sgd_momentum)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)


def inner_step(cfg, model, opt, iterators, iteration, micro_batches):
    for group in opt.param_groups:
        group["lr"] = lr_at(iteration, cfg)
    opt.zero_grad(set_to_none=True)
    count = micro_batches * len(iterators)
    for _ in range(micro_batches):
        for it in iterators:
            b = next(it)
            losses = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
            mask = b["loss_mask"].float()
            loss = (losses.float() * mask).sum() / mask.sum()
            (loss / count).backward()
    if cfg.optimizer.clip_grad > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad)
    opt.step()


def main():
    out_dir, argv = sys.argv[1], sys.argv[2:]
    cfg = parse_args(argv)
    s = cfg.streaming
    M = s.diloco_workers
    world = int(os.environ.pop("REFERENCE_WORLD_SIZE"))  # of the distributed run it mirrors
    DP = world // (M * cfg.parallel.tensor_model_parallel_size
                   * cfg.parallel.pipeline_model_parallel_size
                   * cfg.parallel.ds_sequence_parallel_size)
    patches.apply()
    tokenizer = load_run_tokenizer(cfg)
    models = single_process_models(cfg, tokenizer, M)
    initial = models[0]
    opts = [inner_optimizer(cfg, m) for m in models]
    iterators = worker_iterators(cfg, tokenizer, M, DP)
    micro_batches = num_microbatches(cfg, DP)

    plan, schedule = fragment_plan(cfg), sync_schedule(cfg)
    names = [n for n, _ in initial.named_parameters()]
    fragment = {n: plan.fragment_of(n) for n in names}
    theta_g = {n: torch.nn.Parameter(p.detach().clone()) for n, p in initial.named_parameters()}
    outer = {p: torch.optim.SGD([theta_g[n] for n in names if fragment[n] == p],
                                lr=s.diloco_outer_lr, momentum=s.diloco_outer_momentum,
                                nesterov=s.diloco_nesterov and s.diloco_outer_momentum > 0)
             for p in range(plan.num_fragments)}
    pending = {}
    for step in range(1, cfg.training.train_iters + 1):
        for w in range(M):
            inner_step(cfg, models[w], opts[w], iterators[w], step - 1, micro_batches)
        local = [dict(m.named_parameters()) for m in models]
        for p in schedule.sends_after(step):
            pending[p] = {}
            for n in names:
                if fragment[n] == p:
                    total = theta_g[n].detach() - local[0][n].detach()
                    for w in range(1, M):
                        total = total + (theta_g[n].detach() - local[w][n].detach())
                    pending[p][n] = total / M
        merging = list(schedule.merges_after(step))
        if step == cfg.training.train_iters:  # the end: what is still in flight merges now
            merging += sorted(set(pending) - set(merging))
        for p in merging:
            mean = pending.pop(p)
            for n, d in mean.items():
                theta_g[n].grad = d
            outer[p].step()
            with torch.no_grad():
                for n in mean:
                    for w in range(M):
                        local[w][n].mul_(s.diloco_alpha).add_(theta_g[n],
                                                              alpha=1 - s.diloco_alpha)
    torch.save({"local": [{n: p.detach().clone() for n, p in m.named_parameters()}
                          for m in models],
                "global": {n: t.detach().clone() for n, t in theta_g.items()}},
               os.path.join(out_dir, "reference.pt"))


if __name__ == "__main__":
    main()
