"""One read of a checkpoint's part into this rank's parameters, whatever layout wrote it: each
tensor comes back whole-parameter shaped (``state.Slot``), in this rank's TP slice; a
vocabulary padded for another TP size is read whole and this rank's rows taken from it.
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from . import keys
from .state import LayoutMap, sharded, vocab_rows, whole
from .store import part_keys


class SlotReader:
    """``want`` what to read, by kind; ``read`` reads it all at once."""

    def __init__(self, layout: LayoutMap, meta: dict, part: str):
        self.map = layout
        self.part = part
        self.stored = part_keys(meta, part)
        self.shapes = meta["params"]
        self.request: dict = {}
        self._wanted: List[Tuple[str, object, str, bool]] = []  # (kind, slot, key, model)

    def want(self, kind: str, prefixes: Iterable[str], dtype=torch.float32,
             model: bool = False, into: Optional[Dict[int, torch.Tensor]] = None,
             unless: Optional[str] = None) -> None:
        """Per slot, the first of ``prefixes`` (``keys``) the part stores, as ``kind``; a
        slot with none of them has no ``kind``. ``model``: the model's weights (their rows
        beyond a stored vocabulary keep the parameter's). ``into``: slot index -> where its
        tensor is to end up (a view of live state of ``dtype``): read there directly.
        ``unless``: not for a slot that already has that kind."""
        prefixes = list(prefixes)
        had = {slot.index for k, slot, _, _ in self._wanted if k == unless}
        for slot in self.map.slots:
            key = next((k for k in (keys.tensor(p, slot.gname) for p in prefixes)
                        if k in self.stored), None)
            if key is None or slot.index in had:
                continue
            stored = tuple(self.shapes[slot.gname])
            if stored == slot.global_shape(self.map.tp):
                target = (into or {}).get(slot.index)
                if target is None or target.dtype != dtype:
                    target = torch.empty_like(slot.param, dtype=dtype)
                self.request[key] = sharded(key, slot, target, self.map.tp_rank, self.map.tp,
                                            False)
            else:  # a vocabulary padded for another TP size: read it whole, take our rows
                self.request[key] = whole(key, stored, dtype)
            self._wanted.append((kind, slot, key, model))

    def want_rank_tensor(self, key: str, like: torch.Tensor) -> None:
        """A tensor of this rank's own (an RNG state), shaped as ``like``."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        self.request[key] = ShardedTensor.from_rank_offsets(key, torch.empty_like(like),
                                                            replica_id=1)

    def read(self, directory: str) -> Tuple[Dict[str, Dict[int, torch.Tensor]], dict]:
        """(kind -> slot index -> whole parameter, every key read -> its tensor)."""
        from megatron.core.dist_checkpointing import load as dist_load

        # Loads need not cover every tensor (that is checked when saving).
        loaded = dist_load(self.request, os.path.join(directory, self.part),
                           validate_access_integrity=False)
        values: Dict[str, Dict[int, torch.Tensor]] = {}
        for kind, slot, key, model in self._wanted:
            t, param = loaded[key], slot.param.detach()
            if t.shape != slot.stored_view(param).shape:
                t = vocab_rows(slot, t, param if model else param.float(), self.map.tp_rank,
                               self.map.tp)
            else:
                t = t.reshape(slot.param.shape)
            values.setdefault(kind, {})[slot.index] = t
        return values, loaded
