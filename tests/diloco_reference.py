"""Streaming DiLoCo in one process, in plain torch: the reference for the distributed code.

    python tests/diloco_reference.py OUT flags...      (the flags of pretrain_gpt.py)

M simulated workers, each a full single-process copy of the same initial GPT, each trained on
exactly the samples its ranks read in the distributed run, with torch's own AdamW (or SGD) and
gradient clipping. The outer step is torch's SGD with Nesterov momentum on the global copy.
Nothing of the library's sync, transport or codec is used, so a bug there cannot hide in both.
Writes OUT/reference.pt: per worker the local parameters, and the global parameters.

``--diloco-eager``: each worker keeps its own global copy and outer optimizer; at a fragment's
send it steps with the previous round's mean, less its own share of it (applied a round ago),
plus its fresh outer gradient over M (arXiv 2502.12996). Writes each worker's global copy too.

``REFERENCE_DROP=W:S:D``: elastic workers, worker W leaving after step S and the others going
on after noticing it at step D (see ``main``); ``REFERENCE_READD=W:T``: it rejoins after
step T.

A resume under other flags (``REFERENCE_RESUME_AT=R``, ``REFERENCE_RESUME_ARGS``: a JSON list of
the second run's flags, ``REFERENCE_RESUME_WORLD_SIZE``) continues after step R as the
checkpoint rules say: another sync schedule merges the exchange in flight at once and keeps
each parameter's outer momentum; more workers start from the global parameters with worker
0's inner optimizer state (fewer keep the first ones); the data continues from R.
"""

import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import patches  # noqa: E402
from megatron_streaming.parallel import distributed
from megatron_streaming.worker import weights  # noqa: E402
from megatron_streaming.cli.arguments import parse_args  # noqa: E402
from megatron_streaming.config import ParallelConfig  # noqa: E402
from megatron_streaming.data import MicroBatchSampler, build_iterator  # noqa: E402
from megatron_streaming.data.inputs import RunData, load_run_tokenizer  # noqa: E402
from megatron_streaming.worker.model import build_model  # noqa: E402
from megatron_streaming.streaming.settings import fragment_plan, sync_schedule  # noqa: E402
from megatron_streaming.parallel.topology import RankLayout, Topology  # noqa: E402
from seams import lr_at, num_microbatches  # noqa: E402


def single_process_models(cfg, tokenizer, count):
    """``count`` identical copies of the initial model (modules holding process groups cannot
    be deep-copied; the layout-free initialisation makes fresh builds identical)."""
    global _TOPOLOGY
    distributed.init_distributed("gloo", 5)
    _TOPOLOGY = Topology.create(RankLayout(1, moe=cfg.model.moe), 0)
    _TOPOLOGY.install_into_megatron()
    return [_build(cfg, tokenizer) for _ in range(count)]


_TOPOLOGY = None  # the world-1 topology every model of this process is built in


def _build(cfg, tokenizer):
    topo = _TOPOLOGY
    distributed.seed_everything(cfg.training.seed, 0)
    model = build_model(cfg.model, ParallelConfig(), topo, tokenizer.vocab_size)
    weights.initialize_weights(model, seed=cfg.training.seed, std=cfg.model.init_method_std,
                               num_layers=cfg.model.num_layers, layer_offset=0, tp_rank=0,
                               tp_size=1, gated_mlp=cfg.model.swiglu,
                               zero_centered_norms=cfg.model.apply_layernorm_1p)
    return model


def worker_iterators(cfg, tokenizer, M, DP, start_iteration=0):
    """iterators[w][d]: what data-parallel rank d of worker w reads in the distributed run."""
    layout = RankLayout(M * DP, M)
    stub = SimpleNamespace(layout=layout, data_shard=(0, M * DP), dp_rank=0)
    data = RunData(cfg, stub, tokenizer)
    consumed = data.samples_through(start_iteration)
    return [[build_iterator(data.train, MicroBatchSampler(
        len(data.train), consumed, cfg.training.micro_batch_size, w * DP + d, M * DP))
        for d in range(DP)] for w in range(M)]


def _layout(world, M, cfg=None, worker=0):
    """The run's layout as worker ``worker`` (flags ``cfg``) sees it; ``world``: the job's
    ranks, or a tuple of each worker's where workers differ in size."""
    p = cfg.parallel if cfg is not None else None
    axes = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
            p.ds_sequence_parallel_size) if p else ()
    if isinstance(world, tuple):
        return RankLayout(sum(world), M, *axes, sizes=world, worker=worker)
    return RankLayout(world, M, *axes)


def job_shape(cfgs, world):
    """Every worker's shape (``workers.JobShape``) from its flags."""
    from megatron_streaming.job.workers import JobShape, WorkerShape

    return JobShape(tuple(WorkerShape.of(c, _layout(world, len(cfgs), c, w))
                          for w, c in enumerate(cfgs)))


def block_iterators(cfgs, tokenizer, world, start_iteration=0):
    """iterators[w][d] for workers of different batches: worker w's block of every step."""
    from megatron_streaming.data.sampler import WorkerBlockSampler

    job = job_shape(cfgs, world)
    stub = SimpleNamespace(layout=_layout(world, len(cfgs)), data_shard=(0, 1), dp_rank=0)
    data = RunData(cfgs[0], stub, tokenizer, job)
    consumed = data.samples_through(start_iteration)
    return [[build_iterator(data.train, WorkerBlockSampler(
        len(data.train), consumed, s.micro_batch_size, d, s.dp, job.offset(w),
        s.global_batch_size, job.job_batch)) for d in range(s.dp)]
        for w, s in enumerate(job.workers)]


# --decoupled-lr: what Megatron-LM trains at it (its is_embedding_or_output_parameter).
DECOUPLED = ("embedding.word_embeddings.weight", "output_layer.weight")


def inner_optimizer(cfg, model):
    o = cfg.optimizer
    own = [p for n, p in model.named_parameters() if o.decoupled_lr is not None and n in DECOUPLED]
    named = [(n, p) for n, p in model.named_parameters() if all(p is not q for q in own)]
    decay = [p for n, p in named if p.ndim > 1 and not n.endswith(".bias")]
    rest = [p for n, p in named if not (p.ndim > 1 and not n.endswith(".bias"))]
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    if own:
        floor = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
        groups.append({"params": own, "weight_decay": o.weight_decay,
                       "max_lr": o.decoupled_lr, "min_lr": floor})
    if o.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.sgd_momentum)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)


def inner_step(cfg, model, opt, iterators, iteration, micro_batches):
    for group in opt.param_groups:
        group["lr"] = lr_at(iteration, cfg, max_lr=group.get("max_lr"),
                            min_lr=group.get("min_lr"))
    opt.zero_grad(set_to_none=True)
    count = micro_batches * len(iterators)
    if cfg.model.moe:  # the load-balancing loss's share of the mean, as megatron's schedule
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / count))
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


def data_parallel_size(cfg, world):
    """DP of ``cfg``'s layout; ``world``: the job's ranks, or each worker's (``cfg`` then
    being worker 0's flags, and the other workers' own flags taken afterwards)."""
    per_replica = cfg.parallel.tensor_model_parallel_size \
        * cfg.parallel.pipeline_model_parallel_size * cfg.parallel.ds_sequence_parallel_size
    if isinstance(world, tuple):
        return max(1, world[0] // per_replica)
    return world // (cfg.streaming.diloco_workers * per_replica)


class Reference:
    """The algorithm's state: M models and inner optimizers, theta_g, outer optimizers."""

    def __init__(self, cfg, tokenizer, world):
        self.tokenizer = tokenizer
        M = cfg.streaming.diloco_workers
        self.models = single_process_models(cfg, tokenizer, M)
        self.opts = [inner_optimizer(cfg, m) for m in self.models]
        self.names = [n for n, _ in self.models[0].named_parameters()]
        self.theta_g = {n: torch.nn.Parameter(p.detach().clone())
                        for n, p in self.models[0].named_parameters()}
        self.pending = {}
        self.active = list(range(M))  # the workers still in the job (REFERENCE_DROP)
        self.failing = False  # sends fail (a worker was lost and nobody noticed yet)
        self.configure(cfg, world, 0)
        if self.schedule.eager:  # each worker its own global copy, outer optimizer, last share
            self.thetas = [{n: torch.nn.Parameter(t.detach().clone())
                            for n, t in self.theta_g.items()} for _ in range(self.M)]
            self.eager_outer = [self._outer_optimizers(theta) for theta in self.thetas]
            self.own = [{} for _ in range(self.M)]

    def configure(self, cfg, world, start):
        self.cfg, self.M = cfg, cfg.streaming.diloco_workers
        self.DP = data_parallel_size(cfg, world)
        self.iterators = worker_iterators(cfg, self.tokenizer, self.M, self.DP, start)
        self.micro_batches = num_microbatches(cfg, self.DP)
        self.cfgs = [cfg] * self.M  # each worker's flags (REFERENCE_WORKER_ARGS)
        self.micro_batches_of = [self.micro_batches] * self.M
        self.weights = [1] * self.M  # of the outer mean (relative: each worker's batch)
        self.blocks = None  # the world size, when workers of different batches read blocks
        self.lanes = 0  # workers of different layouts: the lanes the sparse exchange cuts
        self.plan, self.schedule = fragment_plan(cfg), sync_schedule(cfg)
        self.fragment = {n: self.plan.fragment_of(n) for n in self.names}
        old = getattr(self, "outer", {})
        self.outer = self._outer_optimizers(self.theta_g)
        for opt in old.values():  # each parameter keeps its outer momentum
            for param, state in opt.state.items():
                self.outer[self.fragment[self._name(param)]].state[param] = state

    def configure_workers(self, cfgs, world):
        """Workers of their own layouts and batches: each reads its block of every step and
        counts in the outer mean by its tokens (``--diloco-weighting tokens``)."""
        job = job_shape(cfgs, world)
        self.cfgs = cfgs
        if not job.same_batches:
            self.iterators = block_iterators(cfgs, self.tokenizer, world)
            self.blocks = world
        else:
            self.iterators = [worker_iterators(c, self.tokenizer, self.M, s.dp)[w]
                              for w, (c, s) in enumerate(zip(cfgs, job.workers))]
        self.micro_batches_of = [num_microbatches(c, s.dp) for c, s in zip(cfgs, job.workers)]
        if self.cfg.streaming.diloco_weighting == "tokens":  # each worker's batch
            self.weights = [s.global_batch_size for s in job.workers]
        if not job.same_layout:  # the smallest worker's ranks hold the lanes
            self.lanes = min(s.ranks for s in job.workers)

    def _outer_optimizers(self, theta):
        s = self.cfg.streaming
        return {p: torch.optim.SGD(
            [theta[n] for n in self.names if self.fragment[n] == p],
            lr=s.diloco_outer_lr, momentum=s.diloco_outer_momentum,
            nesterov=s.diloco_nesterov and s.diloco_outer_momentum > 0)
            for p in range(self.plan.num_fragments)}

    def _name(self, param):
        return next(n for n, t in self.theta_g.items() if t is param)

    def resume(self, cfg, world, start):
        """Another run resumes the checkpoint of step ``start`` with ``cfg``."""
        if self.schedule.eager or sync_schedule(cfg).eager:
            raise NotImplementedError("the reference does not resume eager runs")
        changed = (fragment_plan(cfg), sync_schedule(cfg)) != (self.plan, self.schedule)
        if changed:  # the exchange in flight merges at load
            for p in sorted(self.pending):
                self.merge(p)
        M = cfg.streaming.diloco_workers
        tokenizer = self.tokenizer
        while len(self.models) < M:  # a new worker: theta_g, worker 0's optimizer state
            model = _build(cfg, tokenizer)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(self.theta_g[n])
            opt = inner_optimizer(cfg, model)
            source = self.opts[0]
            by_name = dict(zip(self.names, self.models[0].parameters()))
            for n, p in model.named_parameters():
                if by_name[n] in source.state:
                    opt.state[p] = {k: v.clone() for k, v in source.state[by_name[n]].items()}
            self.models.append(model)
            self.opts.append(opt)
        del self.models[M:], self.opts[M:]
        self.active = list(range(M))
        self.configure(cfg, world, start)

    def readd(self, w, step):
        """Worker ``w`` rejoins after ``step``: what is in flight merges first; it starts from
        theta_g with a fresh inner optimizer and the data of the steps after ``step``."""
        for p in sorted(self.pending):
            self.merge(p)
        model = self.models[w]
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(self.theta_g[n])
        self.opts[w] = inner_optimizer(self.cfg, model)
        accumulators = self.__dict__.get("accumulators", {})  # (sparse) it starts empty
        for key in [key for key in accumulators if key[0] == w]:
            del accumulators[key]
        if self.blocks is not None:  # workers of different batches
            self.iterators[w] = block_iterators(self.cfgs, self.tokenizer, self.blocks, step)[w]
        else:
            self.iterators[w] = worker_iterators(self.cfg, self.tokenizer, self.M, self.DP,
                                                 step)[w]
        self.active = sorted([*self.active, w])

    def merge(self, p):
        mean = self.pending.pop(p)
        for n, d in mean.items():
            self.theta_g[n].grad = d
        self.outer[p].step()
        alpha = self.cfg.streaming.diloco_alpha
        with torch.no_grad():
            for n in mean:
                for w in self.active:
                    dict(self.models[w].named_parameters())[n].mul_(alpha).add_(self.theta_g[n],
                                                                  alpha=1 - alpha)

    def step(self, step, last):
        for w in self.active:
            inner_step(self.cfgs[w], self.models[w], self.opts[w], self.iterators[w], step - 1,
                       self.micro_batches_of[w])
        local = [dict(m.named_parameters()) for m in self.models]
        if self.schedule.eager:
            self.eager_step(step, last, local)
            return
        for p in self.schedule.sends_after(step):
            if self.failing:  # the exchange fails: its merge is skipped
                continue
            if self.cfg.streaming.diloco_quantize == "sparse":
                self.pending[p] = self.sparse_mean(p, {w: {
                    n: self.theta_g[n].detach() - local[w][n].detach() for n in self.names}
                    for w in self.active})
                continue
            self.pending[p] = {}
            for n in self.names:
                if self.fragment[n] == p:
                    deltas = [self.theta_g[n].detach() - local[w][n].detach()
                              for w in self.active]
                    weights = [self.weights[w] for w in self.active]
                    if len(set(weights)) == 1:
                        self.pending[p][n] = sum(deltas) / len(self.active)
                    else:  # by tokens: each scaled by its share, then the plain mean
                        k = len(self.active)
                        self.pending[p][n] = sum(d * (k * x / sum(weights))
                                                 for d, x in zip(deltas, weights)) / k
        merging = list(self.schedule.merges_after(step))
        if last:  # the end: what is still in flight merges now
            merging += sorted(set(self.pending) - set(merging))
        for p in merging:
            if p in self.pending:  # else: sent under another schedule, merged at the resume
                self.merge(p)


    def sparse_mean(self, p, deltas, scaled=False):
        """``--diloco-quantize sparse``: per shard (fragment p's parameters of one inner param
        group, flat in the group's order, as ZeRO flattens them; with ``lanes``, workers of
        different layouts: the canonical vector, its parameters by their local-spec names,
        cut in that many lanes), each worker's outer gradient ``deltas[w]`` (times its
        weight's share, unless ``scaled``) into its accumulator e <- decay * e + delta,
        ``sparse_sent`` of it sent and taken out of it, the sent values summed in worker
        order over the workers, then divided by their number."""
        s, k = self.cfg.streaming, len(self.active)
        weights = [self.weights[w] for w in self.active]
        share = [k * x / sum(weights) if len(set(weights)) > 1 and not scaled else 1.0
                 for x in weights]
        accumulators = self.__dict__.setdefault("accumulators", {})
        out = {}
        for g, names in enumerate(self._sparse_units(p)):
            numel = sum(self.theta_g[n].numel() for n in names)
            cuts = self.lanes or 1
            bounds = [lane * numel // cuts for lane in range(cuts + 1)]
            total = None
            for w, x in zip(self.active, share):
                delta = torch.cat([deltas[w][n].reshape(-1) for n in names])
                if x != 1.0:
                    delta = delta * x
                sent = []
                for lane, (a, b) in enumerate(zip(bounds, bounds[1:])):
                    e = accumulators.get((w, g, lane, p), torch.zeros(b - a))
                    target = e * s.diloco_sparse_decay + delta[a:b]
                    # A short last chunk is padded with zeros for the choice only.
                    padded = torch.nn.functional.pad(
                        target, (0, -target.numel() % s.diloco_sparse_chunk))
                    sent.append(sparse_sent(padded, s.diloco_sparse_chunk, s.diloco_sparse_k,
                                            s.diloco_sparse_value_bits)[:target.numel()])
                    accumulators[(w, g, lane, p)] = target - sent[-1]
                sent = torch.cat(sent)
                total = sent.clone() if total is None else total + sent
            mean, offset = total / k, 0
            for n in names:
                size = self.theta_g[n].numel()
                out[n] = mean[offset:offset + size].view_as(self.theta_g[n])
                offset += size
        return out

    def _sparse_units(self, p) -> list:
        """The name lists of fragment p that the sparse exchange chunks on its own: one per
        inner param group (the shards), or, with ``lanes``, the canonical vector's."""
        if self.lanes:
            return [sorted((n for n in self.names if self.fragment[n] == p),
                           key=weights.local_spec_name)]
        name_of = {id(q): n for n, q in self.models[0].named_parameters()}
        units = []
        for group in self.opts[0].param_groups:
            names = [name_of[id(param)] for param in group["params"]]
            units.append([n for n in names if self.fragment[n] == p])
        return [names for names in units if names]

    def eager_step(self, step, last, local):
        for p in self.schedule.sends_after(step):
            self.eager_apply(p, local, sending=True)
        if last:  # the end: what is in flight is applied now, with nothing fresh
            for p in sorted(self.pending):
                self.eager_apply(p, local, sending=False)

    def eager_apply(self, p, local, sending):
        M, alpha = self.M, self.cfg.streaming.diloco_alpha
        names = [n for n in self.names if self.fragment[n] == p]
        previous = self.pending.pop(p, None)
        # Each worker's outer gradient times M x its weight (1 with equal weights): the mean
        # below is then the weighted one, and a worker's own share is its weight's.
        scale = [M * x / sum(self.weights) if len(set(self.weights)) > 1 else 1.0
                 for x in self.weights]
        fresh = [{n: (self.thetas[w][n].detach() - local[w][n].detach()) * scale[w]
                  if sending else torch.zeros_like(local[w][n]) for n in names}
                 for w in range(M)]
        for w in range(M):
            for n in names:
                grad = (fresh[w][n] - self.own[w].get(n, 0.0)) / M
                self.thetas[w][n].grad = grad + previous[n] if previous is not None else grad
            self.eager_outer[w][p].step()
            with torch.no_grad():
                for n in names:
                    local[w][n].mul_(alpha).add_(self.thetas[w][n], alpha=1 - alpha)
            self.own[w].update(fresh[w])
        if sending and self.cfg.streaming.diloco_quantize == "sparse":
            self.pending[p] = self.sparse_mean(p, fresh, scaled=True)
        elif sending:
            self.pending[p] = {n: sum(fresh[w][n] for w in range(M)) / M for n in names}
        self.theta_g = self.thetas[0]


def sparse_sent(x, chunk, k, bits):
    """What a worker sends of ``x`` (whole chunks), decoded, written apart from
    ``comm.sparse``: per chunk, its k entries of largest magnitude (among equal ones the lower
    position), each as its sign times the nearest of the 2^(bits-1) magnitudes s * 2^(m - L + 1)
    below the chunk's absmax s (nearest in linear space: at or above the midpoint
    0.75 * s * 2^(j - L + 1) it is magnitude j); zeros elsewhere."""
    rows = x.view(-1, chunk)
    order = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices[:, :k]
    picked = rows.gather(1, order)
    s = rows.abs().amax(dim=1, keepdim=True)
    levels = 1 << (bits - 1)
    m = torch.zeros_like(picked)
    for j in range(1, levels):
        m += (picked.abs() >= s * (0.75 * 2.0 ** (j - levels + 1))).float()
    magnitude = s * torch.pow(2.0, m - levels + 1)
    values = torch.where(picked < 0, -magnitude, magnitude)
    return torch.zeros_like(rows).scatter(1, order, values).view(-1)


def main():
    out_dir, argv = sys.argv[1], sys.argv[2:]
    cfg = parse_args(argv)
    # Of the distributed run it mirrors: the job's ranks, or each worker's ("2,1").
    world = tuple(int(r) for r in os.environ.pop("REFERENCE_WORLD_SIZE").split(","))
    world = world[0] if len(world) == 1 else world
    resume_at = int(os.environ.pop("REFERENCE_RESUME_AT", "0"))
    patches.apply()
    ref = Reference(cfg, load_run_tokenizer(cfg), world)
    per_worker = os.environ.pop("REFERENCE_WORKER_ARGS", "")
    if per_worker:  # each worker its own flags
        ref.configure_workers([parse_args(a) for a in json.loads(per_worker)], world)
    step, last_cfg = 1, cfg
    if resume_at:
        last_cfg = parse_args(json.loads(os.environ.pop("REFERENCE_RESUME_ARGS")))
        for step in range(1, resume_at + 1):
            ref.step(step, False)
        ref.resume(last_cfg, int(os.environ.pop("REFERENCE_RESUME_WORLD_SIZE")), resume_at)
        step = resume_at + 1
    # Elastic workers: worker W leaves after step S, the others notice after step D (>= S):
    # sends after S fail (their merges are skipped), exchanges not merged by D are dropped,
    # and the mean is over the others from then on.
    drop = [int(x) for x in os.environ.pop("REFERENCE_DROP", "").split(":") if x]
    readd = [int(x) for x in os.environ.pop("REFERENCE_READD", "").split(":") if x]
    for step in range(step, last_cfg.training.train_iters + 1):
        if drop:
            ref.failing = drop[1] < step <= drop[2]
            if step == drop[1] + 1:
                ref.active.remove(drop[0])
        ref.step(step, step == last_cfg.training.train_iters)
        if drop and step == drop[2]:
            ref.pending.clear()
        if readd and step == readd[1]:
            ref.readd(readd[0], step)
    torch.save({"local": [{n: p.detach().clone() for n, p in m.named_parameters()}
                          for m in ref.models],
                "global": {n: t.detach().clone() for n, t in ref.theta_g.items()},
                "globals": [{n: t.detach().clone() for n, t in theta.items()}
                            for theta in getattr(ref, "thetas", [ref.theta_g] * ref.M)]},
               os.path.join(out_dir, "reference.pt"))


if __name__ == "__main__":
    main()
