"""What one rank's run reports: the progress line and scalars of a logged step, the counts
the summary needs (parameters, bytes across workers, peak memory) and the summary itself."""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("megatron_streaming")


def memory_scalars() -> dict:
    """--log-memory-to-tensorboard: this rank's CUDA caching allocator, as Megatron-LM writes
    it (``torch.cuda.memory_stats``: current reserved and allocated bytes, the allocated
    peak, the live allocations); without CUDA, the process's resident memory (current, from
    /proc/self/statm, and its peak), under names of our own."""
    import resource

    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
                "mem-allocated-bytes": stats["allocated_bytes.all.current"],
                "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
                "mem-allocated-count": stats["allocation.all.current"]}
    out = {}
    try:
        with open("/proc/self/statm") as f:
            out["memory/rss-bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak only
        pass
    # The kernel updates its high-water mark lazily: never below what was just read.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["memory/max-rss-bytes"] = max(peak, out.get("memory/rss-bytes", 0))
    return out


def live_world_size(topology) -> int:
    """The job's ranks now: those of the workers of the current membership (an elastic run's
    survivors after a loss, every worker again after a rejoin), each worker its own size; the
    launch's world where there is no membership yet."""
    layout, members = topology.layout, topology.members
    return sum(layout.worker_sizes[w] for w in members) if members else layout.world_size


class RunReport:
    """Reports of a run over its collaborators (the ones that do not change during it)."""

    def __init__(self, cfg, topology, model, engine, sync):
        self.cfg, self.topology, self.model = cfg, topology, model
        self.engine, self.sync = engine, sync
        self._dp_step_bytes = None
        # What the reports of the optimizer's tensors count on this rank, made once.
        from .optimizer_report import CountedSpans, GradZeros

        self.counted = CountedSpans(engine, topology, model)
        self.grad_zeros = None  # --log-num-zeros-in-grad: counts in the optimizer's step
        if cfg.logging.log_num_zeros_in_grad:
            self.grad_zeros = GradZeros(self.counted, self.due)
            engine.step_hooks.append(self.grad_zeros)
        self.expert_load = None  # the MoE routers' counts and losses
        if cfg.model.moe:
            from ..worker.expert_load import ExpertLoad

            m = cfg.model
            self.expert_load = ExpertLoad(
                model, m.num_layers, m.num_experts, m.moe_router_topk,
                counts_tokens=cfg.parallel.sequence_parallel or topology.tp_rank == 0)

    def due(self, iteration: int) -> bool:
        """Whether ``log_step`` runs after this iteration: a progress line (every
        --log-interval, and the last iteration) or a point (every --tensorboard-log-interval)."""
        return self._at_log(iteration) or self._at_point(iteration)

    def _at_log(self, iteration: int) -> bool:
        return iteration % self.cfg.logging.log_interval == 0 or \
            iteration == self.cfg.training.train_iters

    def _at_point(self, iteration: int) -> bool:
        # Not given: with each progress line, so that a step that prints nothing reads
        # nothing on the host (Megatron-LM's default, 1, reads the loss after every step).
        interval = self.cfg.logging.tensorboard_log_interval
        if interval is None:
            return self._at_log(iteration)
        return iteration % interval == 0

    def log_step(self, iteration: int, result, throughput, data, writer,
                 step_seconds: float) -> None:
        """Called on every rank where ``due``: the sync's scalars, the timers, the
        parameters' norm and what the optimizer holds are reduced over the worker first;
        the logging rank prints the progress line (every --log-interval) and writes a point
        (every --tensorboard-log-interval), under Megatron-LM's names and conditions
        (``megatron_scalars``) beside this project's own (``streaming/``, ``traffic/``,
        ``moe/``, ``train/tokens``...)."""
        from ..streaming import report
        from ..worker import timers
        from .metrics import progress_line

        topo, log_cfg = self.topology, self.cfg.logging
        at_log, at_point = self._at_log(iteration), self._at_point(iteration)
        scalars = report.worker_scalars(self.sync, topo.groups["worker"],
                                        topo.cross.control_bytes)
        if at_point:  # the per-interval counts cover the iterations since the last point
            report.reset_interval_stats(self.sync)
        # Megatron-LM's timers follow --log-interval (its normalizer), not the points.
        times = self.engine.timers.report(topo.groups["worker"]) if at_log else {}
        if topo.layout.workers == 1:  # also beside one worker's outer optimizer (no bytes)
            step_bytes = self.data_parallel_step_bytes()
            if step_bytes:
                scalars["traffic/data_parallel_bytes"] = iteration * step_bytes
        if self.expert_load is not None:
            from ..parallel.topology import device_of

            group = topo.groups["worker"]
            scalars.update(self.expert_load.scalars(group, device_of(group)))
        params_norm = self.params_norm() if log_cfg.log_params_norm else None
        zeros, optimizer_states = self._optimizer_reports(at_point)
        if not topo.is_logging_rank():
            return
        rate = throughput.rate(iteration)
        per_iteration = throughput.seconds_per_iteration(iteration) if at_log else None
        samples = data.samples_through(iteration)
        step_samples = samples - data.samples_through(iteration - 1)
        tflops = self.tflops_per_gpu(step_samples, per_iteration) if per_iteration else None
        extra = ""
        if self.sync.enabled:
            extra = (f" | sync bytes {scalars['streaming/worker_bytes_sent']:,.0f} | drift "
                     f"{scalars['streaming/drift']:.4f}")
        for name in ("load_balancing_loss", "seq_load_balancing_loss", "z_loss"):
            if f"moe/{name}" in scalars:  # Megatron-LM's names, mean over the MoE layers
                extra += f" | {name.replace('_', ' ')} {scalars[f'moe/{name}']:.6f}"
        legacy = {}
        if result.decoupled_lr is not None:  # as Megatron-LM logged it
            extra += f" | decoupled lr {result.decoupled_lr:.3e}"
            scalars["train/decoupled_lr"] = result.decoupled_lr
        if result.loss_scale is not None:  # --fp16, as Megatron reports it (this worker's)
            skipped = self.engine.skipped_iterations
            extra += f" | loss scale {result.loss_scale:g} | skipped iterations {skipped}"
            scalars["train/skipped_iterations"] = skipped
            legacy["train/loss_scale"] = result.loss_scale
        if zeros is not None:
            extra += f" | num zeros {zeros}"
        if params_norm is not None:
            extra += f" | params norm {params_norm:.3f}"
        if tflops is not None and log_cfg.log_throughput:
            extra += f" | throughput per GPU (TFLOP/s/GPU) {tflops:.1f}"
        if at_log:
            log.info(progress_line(iteration, self.cfg.training.train_iters, result.loss,
                                   result.lr, result.grad_norm, rate, throughput.elapsed(),
                                   extra))
        if times:
            log.info(timers.format_report(times, self.engine.timers.option))
            legacy.update(timers.scalars(times))  # ms, whatever --log-timers-to-tensorboard
        point = {}
        if at_point:
            batch = data.batches.global_batch(iteration - 1)
            tokens = data.tokens_through(iteration)
            point.update(self.megatron_scalars(result, batch, params_norm, zeros))
            point.update({"train/tokens_per_s": rate, "train/tokens": tokens, **scalars})
            point.update(optimizer_states or {})
            legacy.update({"train/loss": result.loss, "train/lr": result.lr,
                           "train/grad_norm": result.grad_norm,
                           "train/global_batch_size": batch,
                           "train/step_seconds": step_seconds,
                           "train/tokens_per_s": rate, "train/tokens": tokens})
            if optimizer_states:  # Megatron-DeepSpeed's second axis for them
                writer.vs_tokens(tokens, optimizer_states)
        if at_log and log_cfg.log_timers_to_tensorboard:
            point["iteration-time"] = per_iteration
            if log_cfg.log_throughput:
                point["throughput"] = tflops
            # Megatron-LM's timers: the worker's maximum, seconds per iteration.
            point.update({f"{name}-time": max(values) for name, values in times.items()})
        if point or legacy:
            writer.scalars(iteration, point, samples=samples if at_point else None,
                           legacy=legacy)

    def _optimizer_reports(self, at_point: bool):
        """(``num-zeros``, the ``optimizer/...`` scalars), each where its flag asks for it
        (collective over the worker)."""
        zeros = self.grad_zeros.total() if self.grad_zeros is not None else None
        if not (at_point and self.cfg.logging.log_optimizer_states_to_tensorboard):
            return zeros, None
        from .optimizer_report import optimizer_states

        return zeros, optimizer_states(self.counted)

    def megatron_scalars(self, result, batch_size: int, params_norm, zeros=None) -> dict:
        """One point's training scalars as Megatron-LM's ``training_log`` names them, under
        its flags: ``lm loss`` (the step's loss), ``learning-rate``, ``batch-size`` (a
        worker's global batch, --global-batch-size), ``grad-norm`` (before clipping),
        ``num-zeros`` (after it), ``loss-scale`` (1 without --fp16), ``world-size`` (the ranks
        of the current membership's workers: ``live_world_size``), ``params-norm`` and the
        memory statistics."""
        log_cfg = self.cfg.logging
        out = {"lm loss": result.loss, "learning-rate": result.lr, "batch-size": batch_size,
               "grad-norm": result.grad_norm}
        if zeros is not None:
            out["num-zeros"] = zeros
        if log_cfg.log_loss_scale_to_tensorboard:
            out["loss-scale"] = result.loss_scale if result.loss_scale is not None else 1.0
        if log_cfg.log_world_size_to_tensorboard:
            out["world-size"] = live_world_size(self.topology)
        if params_norm is not None:
            out["params-norm"] = params_norm
        if log_cfg.log_memory_to_tensorboard:
            out.update(memory_scalars())
        return out

    def tflops_per_gpu(self, step_samples: int, seconds_per_iteration: float) -> float:
        """Megatron-LM's ``throughput``: the step's operations (``flops``: every worker's
        samples) over the iteration time and every rank of the job, in TFLOP/s."""
        return self.operations(step_samples) / \
            (seconds_per_iteration * 1e12 * self.topology.layout.world_size)

    def operations(self, samples: int) -> float:
        """Megatron-LM's count of the floating-point operations of training on ``samples``
        sequences (``flops``)."""
        from ..config.shape import padded_vocab_size
        from .flops import floating_point_operations

        m = self.cfg.model
        vocab = getattr(self.model, "vocab_size", None) or 0
        padded = padded_vocab_size(vocab, m.make_vocab_size_divisible_by, self.topology.layout.tp)
        return floating_point_operations(m, padded, samples)

    def params_norm(self) -> float:
        """Megatron-LM's ``params-norm``: the L2 norm of the whole model's parameters, each
        counted once (``_whole_model``). Under ZeRO (stages 0-2) every data-parallel rank holds
        the whole model's working parameters (bf16/fp16 with mixed precision, where
        Megatron-LM reads the fp32 main copy): the norm is of those, the same on every
        data-parallel rank, so no reduction over them."""
        return self._whole_model(lambda p: p.detach().double().pow(2).sum()) ** 0.5

    def _whole_model(self, value) -> float:
        """The sum of ``value(parameter)`` over the whole model, each parameter counted once
        (collective over TP x PP, and EP for the experts): a tensor-parallel shard on its
        rank, a replicated one (norms, biases) on TP rank 0, the tied embedding on the first
        stage only."""
        import torch
        import torch.distributed as dist

        from ..parallel.topology import device_of
        from ..worker.grads import tied_embedding_weight
        from ..worker.moe import is_expert

        topo = self.topology
        replica = tied_embedding_weight(self.model, topo)
        skip = replica if (replica is not None and not topo.is_first_stage) else None
        group = topo.groups["mp"]
        device = device_of(group)
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # [dense, experts]
        for name, p in self.model.named_parameters():
            if p is not skip and (getattr(p, "tensor_model_parallel", False) or
                                  topo.tp_rank == 0):
                sums[int(is_expert(name))] += torch.as_tensor(value(p), dtype=torch.float64,
                                                              device=device)
        if topo.layout.ep > 1:
            dist.all_reduce(sums[1:], group=topo.groups["ep"])
        dist.all_reduce(sums, group=group)
        return float(sums.sum().item())

    def data_parallel_step_bytes(self) -> int:
        """What one step's gradient all-reduce over the data-parallel ranks moves (ring, fp32):
        the traffic a streaming run is compared against. Counted once, on the first call
        (collective over TP x PP, like every ``log_step``)."""
        if self._dp_step_bytes is None:
            from ..comm.traffic import ring_all_reduce_bytes

            layout = self.topology.layout
            # Under Ulysses the gradients are averaged over the sequence and data axes together.
            ranks = layout.sp * layout.dp
            self._dp_step_bytes = ring_all_reduce_bytes(self.parameter_count(), ranks) \
                if ranks > 1 else 0
        return self._dp_step_bytes

    def peak_memory_mib(self) -> dict:
        """Peak memory of every rank of this worker, in-worker rank order (collective over
        the worker): ``rss`` the resident peak of the process; on a GPU also ``device`` the
        caching allocator's allocated peak (Megatron's "max allocated") and
        ``device_reserved`` what it held from the driver at most (the CUDA context not
        counted in either)."""
        import resource

        import torch
        import torch.distributed as dist

        from ..parallel.topology import device_of

        group = self.topology.groups["worker"]
        device = device_of(group)
        mine = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0]
        keys = ["rss"]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            mine += [torch.cuda.max_memory_allocated() / 2**20,
                     torch.cuda.max_memory_reserved() / 2**20]
            keys += ["device", "device_reserved"]
        mine = torch.tensor(mine, device=device)
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, mine, group=group)
        return {key: [round(float(x[i]), 1) for x in gathered] for i, key in enumerate(keys)}

    def parameter_count(self) -> int:
        """Parameters of the whole model, each counted once (collective over TP x PP)."""
        return int(self._whole_model(lambda p: p.numel()))

    def cross_worker_bytes(self) -> int:
        """Collective over the worker; 0 without the sync."""
        from ..streaming import report

        return report.total_bytes_sent(self.sync, self.topology.groups["worker"],
                                       self.topology.layout.workers)

    def summary(self, run, train_loss, valid_loss, test_loss, peak, sync_bytes,
                parameters, control_bytes) -> dict:
        """The end-of-run summary (``run``: where it stands: iteration, data, step times)."""
        steady = run.step_seconds[1:] or run.step_seconds
        layout = self.topology.layout
        return {
            "iteration": run.iteration,
            "train_loss": train_loss,
            "valid_loss": valid_loss,
            "test_loss": test_loss,
            "tokens": run.data.tokens_through(run.iteration),  # all workers
            "samples": run.data.samples_through(run.iteration),
            "cross_worker_bytes": sync_bytes,
            # Everything else that crossed workers (crossworker.CrossWorker): the stop flag,
            # checkpoint agreement, the door, heartbeats of the workers without the store.
            "cross_worker_control_bytes": control_bytes,
            "parameters": parameters,
            "wall_seconds": time.perf_counter() - run.start_time,
            "workers": layout.workers,
            "world_size": layout.world_size,
            # Mean step time after the first step (which pays one-off set-up costs).
            "seconds_per_iteration": sum(steady) / len(steady) if steady else None,
            "peak_rss_mib_per_rank": peak["rss"],  # ranks of worker 0, in-worker rank order
            # On a GPU: the allocator's allocated and reserved peaks, same order (else absent).
            **{f"peak_{key}_mib_per_rank": peak[key] for key in ("device", "device_reserved")
               if key in peak},
            "stopped_by": run.stopped_by,  # a signal that ended training early, or None
            "checkpoint_iteration": run.last_saved,
        }
