"""What a change of the job's members (``job.elastic``) does to the streaming sync: the
exchanges in flight dropped (``abandon``), theta_g and the outer momentum handed from one
member to all (``share_global_state``), exchanges merged already marked (``mark_merged``),
and a new membership's transport (``regroup``)."""

from __future__ import annotations

import torch


class MembershipChanges:
    """Mixed into ``StreamingSync`` (``CanonicalSync`` adds its lanes to each)."""

    def abandon(self) -> None:
        """Drop every exchange not merged yet (their groups were aborted): theta_g keeps its
        value for them, on every survivor alike."""
        self.pending.clear()
        self._outbox.clear()
        self._merge_later.clear()
        self.merged_early.clear()

    def share_global_state(self, src: int, cross) -> None:
        """theta_g and the outer momentum of the member at index ``src`` of the epoch, to
        every member (collective over the cross-worker data groups; counted as control)."""
        import torch.distributed as dist

        if torch.cuda.is_available():  # copies out of a pinned theta_g may still read it
            torch.cuda.current_stream().synchronize()
        for tensors in (self.theta_g, self.momentum):
            for t in tensors:
                on_wire = t.to(cross.data_device)
                dist.broadcast(on_wire, group_src=src, group=cross.data_group)
                t.copy_(on_wire)
                cross.count_control(t.numel() * t.element_size() * (cross.workers - 1))

    def mark_merged(self, fragments) -> None:
        """The exchanges of ``fragments`` were merged already (into the state a rejoining
        worker took, or by ``finish`` before a checkpoint): their scheduled merges do
        nothing."""
        self.merged_early = {g.index for g in self.groups if g.fragment in set(fragments)}

    def regroup(self, cross) -> None:
        """Average over a new membership's groups from now on (``cross``: the CrossWorker,
        already regrouped); the error-feedback residuals carry over (repadded: the chunking
        follows the number of workers)."""
        self.cross = cross
        old = self.transport
        self.transport = cross.make_transport(old.codec, old.timeout, old.codec_device)
        self.workers = cross.workers or self.transport.workers
        for i, f in enumerate(self.feedback):
            if f is not None:
                n = self.groups[i].numel
                self.feedback[i] = f.resized(self.transport.padded_numel(n), n)
        self.transport.bytes_sent, self.transport.bytes_received = \
            old.bytes_sent, old.bytes_received
        old.abandon()
