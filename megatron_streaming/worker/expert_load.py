"""What the MoE routers did between two logged steps: tokens per expert, dropped tokens and
the auxiliary losses, per MoE layer, for the progress line and TensorBoard.

Each router's forward hook counts the tokens its routing map sends to every expert (after
``--moe-expert-capacity-factor`` dropped what did not fit) against the tokens it routed
(tokens x top-k); megatron-core's own tracker (``moe_utils.get_moe_layer_wise_logging_tracker``)
holds the load-balancing and z-losses it computed. ``scalars`` sums the counts over the
worker and averages the losses over its ranks and micro-batches (collective over the worker,
called on every rank), then starts the next interval.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

# megatron-core's tracker names (the losses as it records them: before the coefficient)
LOSSES = ("load_balancing_loss", "seq_load_balancing_loss", "z_loss")


class ExpertLoad:
    def __init__(self, model, num_layers: int, num_experts: int, topk: int,
                 counts_tokens: bool = True):
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_layers, self.num_experts, self.topk = num_layers, num_experts, topk
        # False on the tensor-parallel ranks past the first without sequence parallelism:
        # they route the very tokens the first one does.
        self.counts_tokens = counts_tokens
        # on the routing maps' device (set at the first forward): no host copy per forward
        self.counts = None
        self._handles = [module.register_forward_hook(self._count)
                         for module in model.modules() if isinstance(module, TopKRouter)]

    def _count(self, router, inputs, output) -> None:
        if not router.training:
            return
        routing_map = output[1]
        if self.counts is None:
            self.counts = torch.zeros(self.num_layers, self.num_experts + 2,
                                      dtype=torch.float64, device=routing_map.device)
        row = self.counts[router.layer_number - 1]
        row[self.num_experts + 1] += 1  # forwards of this layer (the losses' mean)
        if self.counts_tokens:
            row[:self.num_experts] += routing_map.sum(dim=0)
            row[self.num_experts] += routing_map.shape[0] * self.topk  # routed

    def scalars(self, group, device) -> Dict[str, float]:
        """This interval's per-layer numbers, summed or averaged over the worker (collective
        over ``group``); then a new interval starts."""
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        tracker = get_moe_layer_wise_logging_tracker()
        counts = torch.zeros(self.num_layers, self.num_experts + 2, dtype=torch.float64) \
            if self.counts is None else self.counts.cpu()
        losses = torch.zeros(len(LOSSES), self.num_layers, dtype=torch.float64)
        for i, name in enumerate(LOSSES):
            if name in tracker:
                losses[i] = tracker[name]["values"].detach().double().cpu()
        both = torch.cat([counts.view(-1), losses.view(-1)]).to(device)
        dist.all_reduce(both, group=group)
        counts = both[:counts.numel()].view_as(counts).cpu()
        losses = both[counts.numel():].view_as(losses).cpu()
        if self.counts is not None:
            self.counts.zero_()
        clear_aux_losses_tracker()
        out: Dict[str, float] = {}
        layer_losses = {name: [] for name in LOSSES}
        for layer in range(self.num_layers):
            forwards = float(counts[layer, self.num_experts + 1])
            if not forwards:
                continue  # a dense layer
            tokens = counts[layer, :self.num_experts]
            routed = float(counts[layer, self.num_experts])
            prefix = f"moe/layer{layer:02d}"
            for e in range(self.num_experts):
                out[f"{prefix}/tokens_per_expert/{e:02d}"] = float(tokens[e])
            out[f"{prefix}/dropped_tokens"] = routed - float(tokens.sum())
            mean = float(tokens.mean())
            out[f"{prefix}/max_over_mean_load"] = float(tokens.max()) / mean if mean else 0.0
            for i, name in enumerate(LOSSES):
                value = float(losses[i, layer])
                if value:
                    # each forward of the layer (every rank, every micro-batch) recorded one
                    layer_losses[name].append(value / forwards)
                    out[f"{prefix}/{name}"] = value / forwards
        for name, values in layer_losses.items():
            if values:
                out[f"moe/{name}"] = sum(values) / len(values)
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
