"""What a checkpoint keeps of the streaming sync, and its restore (torchtitan's ``Stateful``).

``state_dict`` gives, per shard group, flat fp32 tensors on the outer state's device:
``theta_g`` and ``momentum``; with eager updates ``own``, this worker's share of its latest
send, applied already; with error feedback ``residual``, the codec's ``ErrorFeedback`` state
without the transport's padding (which follows the number of workers); and ``exchanges``, the
exchanges in flight by shard group, each with its mean, step, fragment, finiteness and byte
counts. Beside them the fragments in flight after the current step, those ``finish`` merged
early, the step and the transport's byte counters. ``load_state_dict`` takes the same from any
checkpoint; ``merge_at_load`` merges an exchange a new schedule never sent.

``checkpoint.job`` maps the tensors to whole parameters by global name: nothing here knows
how a checkpoint names or lays them out.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..comm.transport import ExchangeResult, Pending
from .outer import eager_grad


class OuterStateful:
    """Mixed into ``StreamingSync`` (and so ``CanonicalSync``): reads and restores its outer
    state, its exchanges in flight and its transport's counters."""

    def settle(self) -> None:
        """Bring the exchanges in flight back to the shards before a save; here they are the
        shards' own already (``CanonicalSync`` brings back its lanes)."""

    def in_flight_fragments(self) -> list:
        """Fragments whose exchange is in flight after the current step, by the schedule
        alone (the same answer on every rank, also one holding no shard of them); none once
        ``finish`` merged them."""
        if self.finished_step == self.step:
            return []
        return self.schedule.in_flight_after(self.step)

    def merged_early_fragments(self) -> list:
        """Fragments ``finish`` merged before their scheduled step (at the current step)."""
        return self.schedule.in_flight_after(self.step) if self.finished_step == self.step \
            else []

    def state_dict(self) -> dict:
        """The outer state to save (collective over the worker for ``CanonicalSync``)."""
        # First wait for the exchanges in flight: the transport's thread updates the
        # error-feedback residual while it encodes, so reading it before would save the value
        # of a moment chosen by the thread scheduler.
        self.settle()
        exchanges = {}
        for index, pending in self.pending.items():
            result, g = pending.wait(), self.groups[index]
            exchanges[index] = {"mean": result.mean[:g.numel], "step": pending.step,
                                "fragment": g.fragment, "all_finite": bool(result.all_finite),
                                "bytes_sent": result.bytes_sent,
                                "bytes_received": result.bytes_received,
                                "quant_error": result.quant_error}
        residual = None
        if any(f is not None for f in self.feedback):
            residual = [f.state_dict()["residual"][:g.numel] if f is not None
                        else torch.zeros(g.numel) for f, g in zip(self.feedback, self.groups)]
        return {"theta_g": list(self.theta_g), "momentum": list(self.momentum),
                "own": list(self.own) if self.own is not None else None,
                "residual": residual, "exchanges": exchanges,
                "in_flight": self.in_flight_fragments(),
                "merged_early": self.merged_early_fragments(), "step": self.step,
                "bytes": (self.transport.bytes_sent, self.transport.bytes_received)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """``state_dict``'s fields, from any checkpoint: ``theta_g`` is required; ``momentum``,
        ``own`` and ``residual`` None start at zero; ``exchanges`` come back as completed
        exchanges, merged at their scheduled step; ``merged_early`` fragments' next merge does
        nothing."""
        for dst, value in zip(self.theta_g, state["theta_g"]):
            dst.copy_(value.to(dst.device))
        momentum = state.get("momentum")
        for i, dst in enumerate(self.momentum):
            dst.copy_(momentum[i].to(dst.device) if momentum is not None
                      else torch.zeros_like(dst))
        own = state.get("own")
        if self.own is not None:
            for i, theta in enumerate(self.theta_g):
                self.own[i] = own[i].to(theta.device) if own is not None \
                    else torch.zeros_like(theta)
        residual = state.get("residual")
        for i, f in enumerate(self.feedback):
            if f is not None:
                padded = torch.zeros_like(f.residual)
                if residual is not None:
                    padded[:residual[i].numel()] = residual[i].to(padded.device)
                f.load_state_dict({"residual": padded})
        self.pending = {}
        for index, e in state.get("exchanges", {}).items():
            g = self.groups[index]
            result = ExchangeResult(e["mean"].to(self.theta_g[index].device), e["all_finite"],
                                    e.get("bytes_sent", 0), e.get("bytes_received", 0),
                                    e.get("quant_error", 0.0), 0.0)
            self.pending[index] = Pending.completed(
                result, e["step"], f"fragment {g.fragment} (param group {g.param_group})")
        self.mark_merged(state.get("merged_early", ()))
        self.transport.bytes_sent, self.transport.bytes_received = state["bytes"]

    def merge_at_load(self, theta_g: torch.Tensor, momentum: torch.Tensor,
                      local: torch.Tensor, mean: Optional[torch.Tensor],
                      own: Optional[torch.Tensor], workers: int) -> None:
        """A resume under another schedule, which never sent the exchange in flight at the
        save: merge it now as its merge step would have done, in place, on tensors of any one
        shape (whole parameters). ``mean`` None: not finite, no outer step and no merge.
        Saved with eager updates, ``own`` is this worker's share of it, applied at its send,
        over the saved run's ``workers``: taken out, as at the eager step."""
        if own is None and mean is None:
            return  # skipped everywhere, as at the merge step: no outer step, no merge
        grad = mean if own is None else \
            eager_grad(own, mean, torch.zeros_like(own), workers)
        self._outer_update(theta_g, momentum, local, grad)
