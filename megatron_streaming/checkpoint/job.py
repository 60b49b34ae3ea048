"""What one rank saves and restores, composed of parts that export and restore their own state
(torchtitan's ``Stateful``): the model's weights, the inner optimizer
(``WorkerEngine.optimizer_state``), the streaming sync's outer state (``StreamingSync``'s
``state_dict``), the RNG (``rng``). Their tensors go to the checkpoint as whole parameters by
global name (``state.LayoutMap``), under the names of ``keys``.

``JobState`` is built once per run from the engine and the sync. ``sharded_state_dict`` is
what ``dist_checkpointing.save`` writes; ``rank_info`` the few numbers per rank that go to the
checkpoint's JSON (``meta``); ``load`` restores from a checkpoint written by any layout, following
the decisions of ``resume.ResumePlan`` (other workers, another sync schedule).
"""

from __future__ import annotations

import collections
import time
from typing import Dict, List, Optional

import torch

from . import keys, meta as checkpoint_meta, resume
from .keys import MASTER, MODEL, MOMENTUM, OWN, PENDING, RESIDUAL, THETA_G
from .reader import SlotReader
from .rng import RngState
from .state import LayoutMap


class JobState:
    def __init__(self, cfg, topology, model, engine, sync, vocab_size=None):
        self.cfg, self.topology, self.engine, self.sync = cfg, topology, engine, sync
        self.vocab_size = vocab_size
        self.worker = topology.worker
        self.map = LayoutMap(cfg, topology, model, engine, sync.groups)
        self.optimizer = engine.optimizer_state
        self.rng = RngState()
        # Every prefix this run's saves wrote (the JSON lists them all).
        self._prefixes: set = set()
        self._saved: dict = {}  # what the latest save wrote, for rank_info

    # ---- saving --------------------------------------------------------------------------
    def sharded_state_dict(self) -> dict:
        """Everything this rank contributes; collective within the worker (ZeRO gathers)."""
        w, m = self.worker, self.map
        out, written = {}, 0

        def add(prefix, tensors):
            nonlocal written
            entries, n = m.sharded(prefix, tensors)
            if entries:
                self._prefixes.add(prefix)
            out.update(entries)
            written += n

        add(keys.worker(w, MODEL), {s.index: s.param.detach() for s in m.slots})
        inner = self.optimizer.state_dict()
        if inner["master"] is not None:
            add(keys.worker(w, MASTER), m.params(inner["master"]))
        for name, vectors in inner["state"].items():
            add(keys.optimizer(w, name), m.params(vectors))
        outer = self.sync.state_dict() if self.sync.enabled else None
        if outer is not None:
            self._add_outer(add, outer)
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        r = self.topology.rank
        rng = self.rng.state_dict()  # this rank's own (restored only into the same layout)
        out.update({keys.rng(r, k): ShardedTensor.from_rank_offsets(keys.rng(r, k), v.clone(),
                                                                     replica_id=0)
                    for k, v in rng.items()})
        self._saved = {"written": written, "rng": sorted(rng), "outer": outer}
        return out

    def _add_outer(self, add, outer: dict) -> None:
        w, m = self.worker, self.map

        params = m.params_of_groups

        # Eager: each worker's global copy is its own (worker 0's stays the global one, read
        # by new workers and the offline tools); so is its latest share.
        eager = outer["own"] is not None
        mine = w if eager and w != 0 else None
        add(keys.outer(THETA_G, mine), params(outer["theta_g"]))
        add(keys.outer(MOMENTUM, mine), params(outer["momentum"]))
        if eager:
            add(keys.outer(OWN, w), params(outer["own"]))
        if outer["residual"] is not None:
            add(keys.outer(RESIDUAL, w), params(outer["residual"]))
        if outer["in_flight"]:
            from ..streaming.settings import fragment_plan

            exchanges, fragments = outer["exchanges"], set(outer["in_flight"])
            tensors = params([exchanges[g.index]["mean"] if g.index in exchanges
                              else torch.zeros(g.numel) for g in self.sync.groups])
            plan = fragment_plan(self.cfg)
            add(keys.outer(PENDING), {i: t for i, t in tensors.items()
                                      if plan.fragment_of(m.slots[i].gname) in fragments})

    def rank_info(self) -> dict:
        """Small per-rank facts for the checkpoint's JSON (gathered to rank 0)."""
        return checkpoint_meta.rank_entry(
            self.topology.rank, self.worker, written=self._saved.get("written", 0),
            prefixes=self._prefixes, shapes=self.map.stored_shapes(),
            optimizer_keys=self.optimizer.keys(), optimizer_steps=self.optimizer.steps(),
            loss_scaler=self.optimizer.loss_scaler(), rng=self._saved.get("rng", []),
            outer=self._saved.get("outer"))

    def describe(self, infos: List[dict]) -> dict:
        """The checkpoint's JSON (on rank 0, from every rank's ``rank_info``)."""
        import dataclasses

        cfg = self.cfg
        data = dataclasses.asdict(cfg.data)
        return checkpoint_meta.description(
            infos, layout=resume.layout_description(self.topology.layout,
                                                    cfg.parallel.zero_stage),
            model_cfg=cfg.model, vocab_size=self.vocab_size,
            tokenizer={k: v for k, v in data.items()
                       if "tokenizer" in k or k in ("vocab_file", "merge_file")},
            precision=cfg.precision.dtype_name, optimizer=cfg.optimizer.optimizer,
            streaming=resume.streaming_description(cfg))

    # ---- loading -------------------------------------------------------------------------
    def load(self, directory: str, meta: dict, plan: "resume.ResumePlan",
             part: str = "") -> dict:
        """Restore this rank from the checkpoint ``directory``'s part ``part``
        (``store.worker_part``); returns the seconds spent reading and restoring."""
        started = time.perf_counter()
        reader = SlotReader(self.map, meta, part)
        src = plan.weights_worker  # None: this worker is new and starts from theta_g
        if src is not None:
            model_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
                meta["precision"], torch.float32)
            # Read where each tensor is to end up (ZeRO's partitions, the optimizer's and the
            # sync's vectors) when this layout holds it whole: no new memory, no second copy.
            # The masters in flight are merged into the weights first: not those then.
            live = self.optimizer.zero_partitions() \
                if not (plan.merge_pending_now and self.sync.enabled) else None
            reader.want(MASTER, [keys.worker(src, MASTER)], into=self.map.slot_views(live))
            # A worker's model weights are its masters rounded: read where no master is.
            reader.want(MODEL, [keys.worker(src, MODEL)], model_dtype, model=True,
                        unless=MASTER)
        # The optimizer's state vectors (made here if its first step has not made them yet).
        moments = {name: self.optimizer.zero_state_vectors(name)
                   for name in plan.optimizer_keys} if plan.optimizer_worker is not None else {}
        for name, vectors in moments.items():
            reader.want(keys.optimizer(plan.optimizer_worker, name),
                        [keys.optimizer(plan.optimizer_worker, name)],
                        into=self.map.slot_views(vectors))
        if self.sync.enabled or src is None:
            # Eager: worker src's own global copy, unless it is worker 0's (the global one).
            mine = [src] if plan.eager_saved and src is not None else []
            for kind in (THETA_G, MOMENTUM):
                live = getattr(self.sync, {THETA_G: "theta_g", MOMENTUM: "momentum"}[kind],
                               None) if self.sync.enabled else None
                reader.want(kind, [*(keys.outer(kind, w) for w in mine), keys.outer(kind)],
                            into=self.map.group_views(live))
            reader.want(PENDING, [keys.outer(PENDING)])
            if plan.eager_saved:
                reader.want(OWN, [keys.outer(OWN, src if src is not None else 0)])
        if self.sync.enabled and src is not None and plan.residuals:
            reader.want(RESIDUAL, [keys.outer(RESIDUAL, src)])
        rng = self.rng.state_dict() if plan.restore_rng else {}
        for name, value in rng.items():
            reader.want_rank_tensor(keys.rng(self.topology.rank, name), value)
        values, loaded = reader.read(directory)
        read = time.perf_counter()
        self._restore(collections.defaultdict(dict, values), plan, moments)
        if plan.restore_rng:
            self.rng.load_state_dict({keys.rng_name(k): v for k, v in loaded.items()
                                      if keys.rng_name(k) is not None})
        return {"read": read - started, "restore": time.perf_counter() - read}

    def _restore(self, values: Dict[str, Dict[int, torch.Tensor]], plan,
                 moments: Dict[str, Optional[List[torch.Tensor]]]) -> None:
        m = self.map
        # A pending merge updates the weights in place: then they must not be the values
        # read (theta_g's, for a new worker).
        weights = self._loaded_weights(values, plan.weights_worker,
                                       copy=plan.merge_pending_now and self.sync.enabled)
        if plan.merge_pending_now and self.sync.enabled:
            self._merge_at_load(weights, values, plan)
        if not self.optimizer.has_master:
            with torch.no_grad():
                for slot in m.slots:
                    slot.param.copy_(weights[slot.index].to(slot.param.dtype))
        w = plan.optimizer_worker
        masters = None
        partitions = self.optimizer.zero_partitions()
        if partitions is not None:  # ZeRO's masters, written in place
            with torch.no_grad():
                m.scatter(weights, out=partitions)
        elif self.optimizer.has_master:
            masters = m.scatter(weights)
        # ZeRO's optimizer state, in the vectors it was read into (``load``): its own, or
        # new ones made once (fresh memory costs a page fault per 4 KiB).
        self.optimizer.load_state_dict({
            "master": masters,
            "state": {k: m.scatter(values[keys.optimizer(w, k)], out=moments.get(k))
                      for k in plan.optimizer_keys},
            "steps": plan.optimizer_steps, "loss_scaler": plan.loss_scaler})
        self.engine.push_to_model()
        if self.sync.enabled:
            self.sync.load_state_dict(self._outer_state(weights, values, plan))

    def _loaded_weights(self, values, src, copy: bool) -> Dict[int, torch.Tensor]:
        """fp32 weights of every slot: the worker's master (or model), else theta_g (the
        tensors read themselves where they are fp32, unless ``copy``)."""
        out = {}
        for slot in self.map.slots:
            i = slot.index
            if src is None:
                t = values[THETA_G].get(i)
                if t is None:
                    raise resume.CheckpointError(
                        f"--load: the checkpoint holds no global parameters for "
                        f"{slot.gname}, needed to start worker {self.worker}")
            else:
                t = values[MASTER].get(i, values[MODEL].get(i))
                if t is None:
                    raise resume.CheckpointError(
                        f"--load: the checkpoint holds no weights of worker {src} for "
                        f"{slot.gname}")
            out[i] = t.float().clone() if copy else t.float()
        return out

    def _merge_at_load(self, weights, values, plan) -> None:
        """Another sync schedule: the exchange in flight is merged at once by the sync, as its
        merge step would have done; a new worker then starts from the new theta_g."""
        for i, mean in values[PENDING].items():
            theta = values[THETA_G][i]
            self.sync.merge_at_load(theta, values[MOMENTUM][i], weights[i],
                                    mean if plan.pending_finite else None,
                                    values[OWN].get(i), plan.saved_workers)
            if plan.weights_worker is None:
                weights[i] = theta.clone()
        values[PENDING], values[OWN] = {}, {}

    def _outer_state(self, weights, values, plan) -> dict:
        """The sync's ``load_state_dict`` fields, per shard group, from whole parameters."""
        m = self.map

        def groups(tensors, live=None):  # into the sync's own vectors (``live``) if it can
            return m.groups_of_params(tensors, out=live) if tensors else None

        exchanges = {}
        for g, mean in zip(self.sync.groups, groups(values[PENDING]) or ()):
            info = plan.pending.get(g.fragment)
            if info is not None:  # kept in flight: merged at its step
                stats = plan.pending_stats.get(g.index, {})  # the same layout's only
                exchanges[g.index] = {"mean": mean, "step": info["step"],
                                      "all_finite": info["all_finite"],
                                      **{k: stats[k] for k in ("bytes_sent", "bytes_received",
                                                               "quant_error") if k in stats}}
        sync = self.sync
        return {"theta_g": groups(values[THETA_G] or weights,  # no sync saved: the weights
                                  getattr(sync, "theta_g", None)),
                "momentum": groups(values[MOMENTUM], getattr(sync, "momentum", None)),
                "own": groups(values[OWN]),
                "residual": groups(values[RESIDUAL]), "exchanges": exchanges,
                "merged_early": plan.nothing_in_flight, "bytes": plan.bytes}


__all__ = ["JobState"]
