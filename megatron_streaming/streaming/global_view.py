"""The sync's global parameters as the run reads them (mixed into ``StreamingSync``): the
model evaluated with them (``global_parameters``), their distance from the local ones for the
progress line (``drift_terms``), and a shard's local parameters on the outer state's device
(``_local_on``, which the sends read too)."""

from __future__ import annotations

import contextlib

import torch

from ..comm.transport import pinned_host_copy


class GlobalView:
    """Reads ``groups`` (the shard groups), ``theta_g``, ``schedule`` and ``push_to_model`` of
    the sync it is mixed into."""

    def _local_on(self, g, device: torch.device) -> torch.Tensor:
        """The shard's local parameters on ``device`` (the outer state's; from a GPU to an
        offloaded outer state through pinned memory)."""
        local = g.read()
        if local.device == device:
            return local
        if local.is_cuda and device.type == "cpu":
            return pinned_host_copy(local)
        return local.to(device)

    @contextlib.contextmanager
    def global_parameters(self):
        saved = [g.read().clone() for g in self.groups]
        for g, theta in zip(self.groups, self.theta_g):
            g.write(theta.to(saved[g.index].device))
        self.push_to_model()
        try:
            yield
        finally:
            for g, local in zip(self.groups, saved):
                g.write(local)
            self.push_to_model()

    def drift_terms(self) -> torch.Tensor:
        """Per fragment: [||theta_local - theta_g||^2, ||theta_g||^2] on this rank.

        Runs at every progress report: one difference and two dot products per shard (fp32
        accumulation, plenty for a monitoring ratio), about a third of the cost of squaring
        in fp64 with temporaries."""
        out = torch.zeros(self.schedule.num_fragments, 2, dtype=torch.float64)
        for g, theta in zip(self.groups, self.theta_g):
            diff = torch.sub(self._local_on(g, theta.device), theta)
            out[g.fragment, 0] += float(torch.dot(diff, diff))
            out[g.fragment, 1] += float(torch.dot(theta, theta))
        return out
