"""What one rank saves and restores: its model chunk, its optimizer partition, its share of the
streaming sync's state, its RNG; as ``ShardedTensor``s keyed by global names (``state``).

``JobState`` is built once per run from the engine and the sync. ``sharded_state_dict`` is
what ``dist_checkpointing.save`` writes; ``rank_info`` the few numbers per rank that go to the
checkpoint's JSON; ``load`` restores from a checkpoint written by any layout, following the
decisions of ``resume.ResumePlan`` (other workers, another sync schedule).
"""

from __future__ import annotations

import logging
import random
from typing import Dict, List, Optional

import torch

from patches import deepspeed_zero

from . import resume
from .state import (EMBEDDING, GroupSpace, build_slots, group_spaces, replica_writer, sharded,
                    vocab_rows, whole)

log = logging.getLogger("megatron_streaming")


class JobState:
    def __init__(self, cfg, topology, model, engine, sync, vocab_size=None):
        self.cfg, self.topology, self.engine, self.sync = cfg, topology, engine, sync
        self.vocab_size = vocab_size
        self._prefixes: set = set()
        layout = topology.layout
        self.tp_rank, self.tp = topology.tp_rank, layout.tp
        self.worker = topology.worker
        offset = topology.first_layer(cfg.model.num_layers)
        tied = not cfg.model.untie_embeddings_and_output_weights
        self.slots = build_slots(model, offset, tied, cfg.model.swiglu)
        self.spaces: List[GroupSpace] = group_spaces(engine, self.slots)
        # The ranks holding the same slices: ZeRO's group (sequence x data parallel).
        sdp = topology.groups.get("sdp")
        import torch.distributed as dist

        self.sdp_rank = dist.get_rank(sdp) if sdp is not None else 0
        self.sdp_size = dist.get_world_size(sdp) if sdp is not None else 1
        # Per shard group of the sync: (position in its space, length) of each of its views.
        self.pieces = [[(self.spaces[g.param_group].position(t), t.numel()) for t in g.tensors]
                       for g in sync.groups]

    # ---- what is there -------------------------------------------------------------------
    @property
    def has_master(self) -> bool:
        return self.engine.zero or self.engine.sixteen_bit_without_zero

    def _state_tensors(self, i: int) -> List[torch.Tensor]:
        """The tensors the inner optimizer keeps state for, in param group ``i``."""
        if self.engine.zero:
            return [deepspeed_zero.fp32_partition(self.engine.optimizer, i)]
        return [v for _, v in self.engine.master_views()[i]]

    def optimizer_keys(self) -> List[str]:
        """Per-element state of the inner optimizer (empty before its first step)."""
        state = self.engine.inner_optimizer.state
        for i in range(len(self.spaces)):
            for t in self._state_tensors(i):
                if t in state:
                    return sorted(k for k, v in state[t].items()
                                  if torch.is_tensor(v) and v.numel() == t.numel())
        return []

    def optimizer_steps(self) -> List[Optional[float]]:
        state = self.engine.inner_optimizer.state
        steps = []
        for i in range(len(self.spaces)):
            found = [state[t]["step"] for t in self._state_tensors(i)
                     if t in state and "step" in state[t]]
            steps.append(float(found[0]) if found else None)
        return steps

    def _master_vector(self, i: int) -> torch.Tensor:
        if self.engine.zero:
            return deepspeed_zero.fp32_partition(self.engine.optimizer, i)
        return torch.cat([v.detach().reshape(-1).float() for v in self._state_tensors(i)]) \
            if self._state_tensors(i) else torch.zeros(0)

    def _optimizer_vector(self, i: int, key: str) -> torch.Tensor:
        state = self.engine.inner_optimizer.state
        parts = [state[t][key].reshape(-1) if t in state and key in state[t]
                 else torch.zeros(t.numel(), device=t.device) for t in self._state_tensors(i)]
        return torch.cat([p.float() for p in parts]) if parts else torch.zeros(0)

    def _sync_vectors(self, values: List[torch.Tensor]) -> List[torch.Tensor]:
        """Per space, the vector holding ``values`` (one flat tensor per shard group)."""
        vectors = [torch.zeros(space.length) for space in self.spaces]
        for g, value in zip(self.sync.groups, values):
            offset = 0
            for position, n in self.pieces[g.index]:
                vectors[g.param_group][position:position + n] = \
                    value[offset:offset + n].detach().float().cpu()
                offset += n
        return vectors

    def _group_values(self, vectors: List[torch.Tensor]) -> List[torch.Tensor]:
        """``_sync_vectors``' inverse: one flat tensor per shard group."""
        values = []
        for g in self.sync.groups:
            vector = vectors[g.param_group]
            values.append(torch.cat([vector[p:p + n] for p, n in self.pieces[g.index]])
                          if self.pieces[g.index] else torch.zeros(0))
        return values

    def _params(self, vectors: List[torch.Tensor]) -> Dict[int, torch.Tensor]:
        out = {}
        for space, vector in zip(self.spaces, vectors):
            out.update(space.gather(vector))
        return out

    # ---- saving --------------------------------------------------------------------------
    def sharded_state_dict(self) -> dict:
        """Everything this rank contributes; collective within the worker (ZeRO gathers)."""
        w = f"worker{self.worker}"
        writer = {s.index: replica_writer(s.gname, self.sdp_rank, self.sdp_size)
                  for s in self.slots}
        out = {}
        self._bytes = 0  # what this rank writes

        def add(key_prefix, tensors):
            for slot in self.slots:
                if slot.index not in tensors:
                    continue
                write = writer[slot.index]  # global state too: each worker's part has it
                key = f"{key_prefix}.{slot.gname}"
                self._prefixes.add(key_prefix)
                if write:
                    t = tensors[slot.index]
                    self._bytes += t.numel() * t.element_size()
                out[key] = sharded(key, slot, tensors[slot.index], self.tp_rank, self.tp,
                                   write)

        add(f"{w}.model", {s.index: s.param.detach() for s in self.slots})
        if self.has_master:
            add(f"{w}.master", self._params([self._master_vector(i)
                                             for i in range(len(self.spaces))]))
        for key in self.optimizer_keys():
            add(f"{w}.optim.{key}", self._params([self._optimizer_vector(i, key)
                                                  for i in range(len(self.spaces))]))
        if self.sync.enabled:
            s = self.sync
            # First wait for the exchanges in flight: the transport's thread updates the
            # error-feedback residual while it encodes, so reading it before would save the
            # value of a moment chosen by the thread scheduler.
            pending = self._pending_means()
            # Eager: each worker's global copy is its own (worker 0's stays the global one,
            # read by new workers and the offline tools); so is its latest share.
            eager = s.own is not None
            outer_key = f"{w}.outer" if eager and self.worker != 0 else "outer"
            add(f"{outer_key}.theta_g", self._params(self._sync_vectors(s.theta_g)))
            add(f"{outer_key}.momentum", self._params(self._sync_vectors(s.momentum)))
            if eager:
                add(f"{w}.outer.own", self._params(self._sync_vectors(s.own)))
            if any(f is not None for f in s.feedback):
                add(f"{w}.outer.residual", self._params(self._sync_vectors(
                    [f.residual[:g.numel] if f is not None else torch.zeros(g.numel)
                     for f, g in zip(s.feedback, s.groups)])))
            if pending is not None:
                means, fragments = pending
                tensors = self._params(self._sync_vectors(means))
                from ..streaming.settings import fragment_plan

                plan = fragment_plan(self.cfg)
                add("outer.pending", {i: t for i, t in tensors.items()
                                      if plan.fragment_of(self.slots[i].gname) in fragments})
        rng = self._rng_tensors()
        self._rng_names = sorted(k.split(".", 2)[2] for k in rng)
        out.update(rng)
        return out

    def _pending_means(self):
        """Means of the exchanges in flight (waited for), per shard group, and their
        fragments; None when nothing is in flight anywhere on this rank's worker."""
        s = self.sync
        # Lanes in flight back to the shards, and the lanes' error-feedback residuals
        # (canonical exchange; collective over the worker, whatever is in flight).
        settle = getattr(s, "settle", None)
        if settle is not None:
            settle()
        fragments = set(s.in_flight_fragments())
        if not fragments:
            return None
        means = []
        for g in s.groups:
            p = s.pending.get(g.index)
            means.append(p.wait().mean[:g.numel].cpu() if p is not None
                         else torch.zeros(g.numel))
        return means, fragments

    def _rng_tensors(self) -> dict:
        """This rank's RNG states (restored only into the same layout)."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        r = self.topology.rank
        version, state, gauss = random.getstate()
        tensors = {"torch": torch.get_rng_state(),
                   "python": torch.tensor([version, *state], dtype=torch.int64)}
        if gauss is not None:
            tensors["python_gauss"] = torch.tensor([gauss], dtype=torch.float64)
        for name, value in get_cuda_rng_tracker().get_states().items():
            tensors[f"tracker.{name}"] = value.cpu()
        if torch.cuda.is_available():
            tensors["cuda"] = torch.cuda.get_rng_state()
        return {f"rng.rank{r}.{k}": ShardedTensor.from_rank_offsets(f"rng.rank{r}.{k}",
                                                                     v.clone(), replica_id=0)
                for k, v in tensors.items()}

    def rank_info(self) -> dict:
        """Small per-rank facts for the checkpoint's JSON (gathered to rank 0)."""
        info = {"rank": self.topology.rank, "worker": self.worker,
                "bytes": getattr(self, "_bytes", 0),
                "prefixes": sorted(self._prefixes), "shapes": self.stored_shapes(),
                "optimizer_steps": self.optimizer_steps(),
                "optimizer_keys": self.optimizer_keys(),
                "rng": getattr(self, "_rng_names", [])}
        if self.engine.cfg.precision.fp16:
            scaler = deepspeed_zero.loss_scaler_state(self.engine.optimizer)
            if scaler:
                info["loss_scaler"] = scaler
        if self.sync.enabled:
            s = self.sync
            info.update(bytes_sent=s.transport.bytes_sent,
                        bytes_received=s.transport.bytes_received, step=s.step,
                        merged_early=s.merged_early_fragments(),
                        error_feedback=any(f is not None for f in s.feedback))
            pending = {}
            for index, p in s.pending.items():
                r = p.wait()
                pending[str(index)] = {"step": p.step, "fragment": s.groups[index].fragment,
                                       "all_finite": bool(r.all_finite),
                                       "bytes_sent": r.bytes_sent,
                                       "bytes_received": r.bytes_received,
                                       "quant_error": r.quant_error}
            info["pending"] = pending
        return info

    def describe(self, infos: List[dict]) -> dict:
        """The checkpoint's JSON (on rank 0, from every rank's ``rank_info``)."""
        import dataclasses

        cfg = self.cfg
        shapes, keys, prefixes, workers, pending, by_part = {}, set(), set(), {}, {}, {}
        for info in infos:
            shapes.update(info.pop("shapes"))
            mine = info.pop("keys")
            keys.update(mine)
            by_part.setdefault(f"worker{info['worker']}", set()).update(mine)
            prefixes.update(info.pop("prefixes"))
            w = info["worker"]
            if w not in workers:
                workers[w] = {"optimizer_keys": info["optimizer_keys"],
                              "optimizer_steps": info["optimizer_steps"],
                              "residuals": info.get("error_feedback", False),
                              "loss_scaler": info.get("loss_scaler", {})}
            for entry in info.get("pending", {}).values():
                p = pending.setdefault(entry["fragment"], {"fragment": entry["fragment"],
                                                           "step": entry["step"],
                                                           "all_finite": True})
                p["all_finite"] = p["all_finite"] and entry["all_finite"]
        numel = 0
        for shape in shapes.values():
            n = 1
            for d in shape:
                n *= d
            numel += n
        data = dataclasses.asdict(cfg.data)
        return {
            "layout": resume.layout_description(self.topology.layout, cfg.parallel.zero_stage),
            "model": {"architecture": resume.architecture(cfg.model),
                      "config": dataclasses.asdict(cfg.model),
                      "vocab_size": self.vocab_size, "parameter_count": numel},
            "tokenizer": {k: v for k, v in data.items()
                          if "tokenizer" in k or k in ("vocab_file", "merge_file")},
            "precision": cfg.precision.dtype_name,
            "optimizer": {"name": cfg.optimizer.optimizer},
            "streaming": resume.streaming_description(cfg),
            "workers": {str(w): v for w, v in sorted(workers.items())},
            "pending": [pending[f] for f in sorted(pending)],
            "merged_early": infos[0].get("merged_early", []),
            "kinds": {"prefixes": sorted(prefixes), "keys": sorted(keys),
                      "keys_by_part": {p: sorted(k) for p, k in sorted(by_part.items())}},
            "params": dict(sorted(shapes.items())),
            "ranks": infos,
        }

    def stored_shapes(self) -> dict:
        """global name -> stored shape (this rank's parameters)."""
        return {s.gname: list(s.global_shape(self.tp)) for s in self.slots}

    # ---- loading -------------------------------------------------------------------------
    def load(self, directory: str, meta: dict, plan: "resume.ResumePlan",
             part: str = "") -> dict:
        """Restore this rank from the checkpoint ``directory``'s part ``part``
        (``store.worker_part``); returns the seconds spent reading and restoring."""
        import os
        import time

        from megatron.core.dist_checkpointing import load as dist_load

        from .store import part_keys

        started = time.perf_counter()
        stored_keys = part_keys(meta, part)
        request, fetched = {}, {}
        shapes = meta["params"]

        def want(key: str, slot, dtype=torch.float32):
            if key not in stored_keys:
                return
            stored = tuple(shapes[slot.gname])
            if stored == slot.global_shape(self.tp):
                request[key] = sharded(key, slot, torch.empty_like(slot.param, dtype=dtype),
                                       self.tp_rank, self.tp, False)
            else:  # a vocabulary padded for another TP size: read it whole, take our rows
                request[key] = whole(key, stored, dtype)
            fetched[key] = slot

        src = plan.weights_worker  # None: this worker is new and starts from theta_g
        model_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(meta["precision"],
                                                                          torch.float32)
        for slot in self.slots:
            if src is not None:
                want(f"worker{src}.model.{slot.gname}", slot, model_dtype)
                want(f"worker{src}.master.{slot.gname}", slot)
            if plan.optimizer_worker is not None:
                for key in plan.optimizer_keys:
                    want(f"worker{plan.optimizer_worker}.optim.{key}.{slot.gname}", slot)
            if self.sync.enabled or src is None:
                for kind in ("theta_g", "momentum", "pending"):
                    want(f"outer.{kind}.{slot.gname}", slot)
                if plan.eager_saved:  # each worker's own outer state (worker 0: the above)
                    for kind in ("theta_g", "momentum"):
                        want(f"worker{src}.outer.{kind}.{slot.gname}", slot)
                    want(f"worker{src if src is not None else 0}.outer.own.{slot.gname}", slot)
            if self.sync.enabled and src is not None and plan.residuals:
                want(f"worker{src}.outer.residual.{slot.gname}", slot)
        if plan.restore_rng:
            from megatron.core.dist_checkpointing.mapping import ShardedTensor

            for key, st in self._rng_tensors().items():
                request[key] = ShardedTensor.from_rank_offsets(
                    key, torch.empty_like(st.data), replica_id=1)
        # Loads need not cover every tensor (that is checked when saving).
        loaded = dist_load(request, os.path.join(directory, part),
                           validate_access_integrity=False)
        read = time.perf_counter()

        def value(kind_key: str, slot) -> Optional[torch.Tensor]:
            if kind_key not in loaded:
                return None
            t = loaded[kind_key]
            if t.shape != slot.stored_view(slot.param.detach()).shape:
                current = slot.param.detach() if ".model." in kind_key else \
                    slot.param.detach().float()
                return vocab_rows(slot, t, current, self.tp_rank, self.tp)
            return t.reshape(slot.param.shape)

        per_kind: Dict[str, Dict[int, torch.Tensor]] = {}

        def collect(kind: str, key_of):
            found = {}
            for slot in self.slots:
                t = value(key_of(slot), slot)
                if t is not None:
                    found[slot.index] = t
            per_kind[kind] = found

        collect("model", lambda s: f"worker{src}.model.{s.gname}")
        collect("master", lambda s: f"worker{src}.master.{s.gname}")
        for kind in ("theta_g", "momentum"):  # eager: worker src's own, if not worker 0
            collect(kind, lambda s, k=kind: f"worker{src}.outer.{k}.{s.gname}"
                    if f"worker{src}.outer.{k}.{s.gname}" in loaded else
                    f"outer.{k}.{s.gname}")
        collect("own", lambda s: f"worker{src if src is not None else 0}.outer.own.{s.gname}")
        collect("pending", lambda s: f"outer.pending.{s.gname}")
        collect("residual", lambda s: f"worker{src}.outer.residual.{s.gname}")
        for key in plan.optimizer_keys:
            collect(f"optim.{key}", lambda s, k=key:
                    f"worker{plan.optimizer_worker}.optim.{k}.{s.gname}")

        self._plan = plan
        weights = self._loaded_weights(per_kind, src)
        if plan.merge_pending_now:
            self._merge_pending(weights, per_kind)
        self._restore_weights(weights, per_kind["model"] if not self.has_master else None)
        self._restore_optimizer(per_kind, plan)
        if self.sync.enabled:
            self._restore_sync(weights, per_kind, plan, meta)
        if plan.restore_rng:
            self._restore_rng({k.split(".", 2)[2]: v for k, v in loaded.items()
                               if k.startswith("rng.")})
        if plan.loss_scaler and self.engine.cfg.precision.fp16:
            deepspeed_zero.restore_loss_scaler(self.engine.optimizer, plan.loss_scaler)
        return {"read": read - started, "restore": time.perf_counter() - read}

    def _loaded_weights(self, per_kind, src) -> Dict[int, torch.Tensor]:
        """fp32 weights of every slot: the worker's master (or model), else theta_g."""
        out = {}
        for slot in self.slots:
            i = slot.index
            if src is None:
                t = per_kind["theta_g"].get(i)
                if t is None:
                    raise resume.CheckpointError(
                        f"--load: the checkpoint holds no global parameters for "
                        f"{slot.gname}, needed to start worker {self.worker}")
            else:
                t = per_kind["master"].get(i, per_kind["model"].get(i))
                if t is None:
                    raise resume.CheckpointError(
                        f"--load: the checkpoint holds no weights of worker {src} for "
                        f"{slot.gname}")
            out[i] = t.float().clone()
        return out

    def _merge_pending(self, weights, per_kind) -> None:
        """Another sync schedule: the exchange in flight is merged at once, as its merge
        step would have done (outer step on theta_g, then the local merge)."""
        from ..streaming.outer import merge

        outer = self.sync.outer if self.sync.enabled else None
        alpha = self.cfg.streaming.diloco_alpha
        workers = self._plan.saved_workers
        for i, mean in per_kind["pending"].items():
            theta, momentum = per_kind["theta_g"][i], per_kind["momentum"][i]
            if not self._plan.pending_finite:
                mean = torch.zeros_like(mean)
            if i in per_kind["own"]:  # eager: this worker's share was applied at its send
                mean = mean - per_kind["own"][i] / workers
            if outer is not None and (self._plan.pending_finite or i in per_kind["own"]):
                outer.step(theta, momentum, mean)
            if self._plan.weights_worker is None:  # a new worker starts from the new theta_g
                weights[i] = theta.clone()
            else:
                merge(weights[i], theta, alpha)
        per_kind["pending"], per_kind["own"] = {}, {}

    @torch.no_grad()
    def _restore_weights(self, weights, model_values) -> None:
        if not self.has_master:
            for slot in self.slots:
                slot.param.copy_(weights[slot.index].to(slot.param.dtype))
            return
        for i, space in enumerate(self.spaces):
            vector = space.scatter(weights)
            if self.engine.zero:
                deepspeed_zero.fp32_partition(self.engine.optimizer, i).copy_(vector)
            else:
                offset = 0
                for t in self._state_tensors(i):
                    t.copy_(vector[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
        self.engine.push_to_model()

    @torch.no_grad()
    def _restore_optimizer(self, per_kind, plan) -> None:
        opt = self.engine.inner_optimizer
        opt.state.clear()
        if not plan.optimizer_keys:
            return  # a fresh inner optimizer: its state is created at the next step
        for i, space in enumerate(self.spaces):
            tensors = self._state_tensors(i)
            vectors = {k: space.scatter(per_kind[f"optim.{k}"]) for k in plan.optimizer_keys}
            step = _group_step(plan.optimizer_steps, i)
            offset = 0
            for t in tensors:
                state = {k: v[offset:offset + t.numel()].view_as(t).to(t.device).clone()
                         for k, v in vectors.items()}
                if step is not None:
                    state["step"] = step_tensor(step, t, opt.param_groups[i])
                opt.state[t] = state
                offset += t.numel()

    def _restore_sync(self, weights, per_kind, plan, meta) -> None:
        from ..comm.transport import ExchangeResult, Pending

        s = self.sync
        theta = per_kind["theta_g"] or weights  # a run without the sync: theta_g = weights
        for dst, value in zip(s.theta_g, self._group_values(
                [space_vec for space_vec in self._space_vectors(theta)])):
            dst.copy_(value.to(dst.device))
        momentum = per_kind["momentum"]
        for dst, value in zip(s.momentum, self._group_values(self._space_vectors(momentum))):
            dst.copy_(value.to(dst.device) if momentum else torch.zeros_like(dst))
        if s.own is not None:
            own = per_kind["own"]
            for i, value in enumerate(self._group_values(self._space_vectors(own))):
                s.own[i] = value.to(s.theta_g[i].device) if own else \
                    torch.zeros_like(s.theta_g[i])
        residual = per_kind["residual"]
        for f, value in zip(s.feedback, self._group_values(self._space_vectors(residual))):
            if f is not None:
                f.residual.zero_()
                if residual:
                    f.residual[:value.numel()] = value.to(f.residual.device)
        s.pending = {}
        if per_kind["pending"]:
            means = self._group_values(self._space_vectors(per_kind["pending"]))
            for g, mean in zip(s.groups, means):
                info = plan.pending.get(g.fragment)
                if info is None:
                    continue
                stats = plan.pending_stats.get(g.index, {})
                result = ExchangeResult(mean.to(s.theta_g[g.index].device), info["all_finite"],
                                        stats.get("bytes_sent", 0),
                                        stats.get("bytes_received", 0),
                                        stats.get("quant_error", 0.0), 0.0)
                s.pending[g.index] = Pending.completed(
                    result, info["step"], f"fragment {g.fragment} (param group {g.param_group})")
        s.merged_early = {g.index for g in s.groups if g.fragment in plan.nothing_in_flight}
        s.transport.bytes_sent, s.transport.bytes_received = plan.bytes

    def _space_vectors(self, tensors: Dict[int, torch.Tensor]) -> List[torch.Tensor]:
        """Per space, this rank's vector of whole-parameter tensors (zeros where missing)."""
        out = []
        for space in self.spaces:
            full = {s.index: tensors.get(s.index, torch.zeros(s.param.shape))
                    for s in space.slots}
            out.append(space.scatter(full))
        return out

    def _restore_rng(self, tensors: dict) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        python = tensors["python"].tolist()
        gauss = float(tensors["python_gauss"][0]) if "python_gauss" in tensors else None
        random.setstate((python[0], tuple(python[1:]), gauss))
        torch.set_rng_state(tensors["torch"].to(torch.uint8))
        tracker = {k[len("tracker."):]: v.to(torch.uint8) for k, v in tensors.items()
                   if k.startswith("tracker.")}
        if tracker:
            get_cuda_rng_tracker().set_states(tracker)
        if "cuda" in tensors and torch.cuda.is_available():
            torch.cuda.set_rng_state(tensors["cuda"].to(torch.uint8))


def _group_step(steps: List[Optional[float]], i: int) -> Optional[float]:
    """Adam's step count of param group ``i`` as saved. Every group steps at every step, so
    a group the checkpoint lacks (--decoupled-lr added on resume: a third group) takes the
    count of the others."""
    if i < len(steps):
        return steps[i]
    return next((s for s in steps if s is not None), None)


def step_tensor(step: float, param: torch.Tensor, group: dict) -> torch.Tensor:
    """Adam's step count where torch keeps it: with the parameter for fused (on a GPU, the
    only fused Adam the run picks) or capturable Adam, on the CPU otherwise, as
    ``Optimizer.load_state_dict`` places it."""
    with_param = bool(group.get("fused") or group.get("capturable"))
    return torch.tensor(step, dtype=torch.float32, device=param.device if with_param else "cpu")


__all__ = ["JobState", "EMBEDDING"]

