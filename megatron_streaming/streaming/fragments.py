"""Which fragment every parameter belongs to (Streaming DiLoCo, arXiv 2501.18512, section 2.2).

A fragment is a set of whole transformer layers: **strided** (fragment p holds layers p, p+P,
p+2P, ...; the paper's choice, it spreads each fragment over the depth) or **sequential**
(consecutive blocks of layers). Parameters outside the layers belong to a fragment too, so
every parameter is in exactly one: the embeddings go with layer 0's fragment, the final norm
and the output layer with the last layer's. A last pipeline stage's copy of a tied embedding
is the same logical parameter as the first stage's embedding and goes with it.

Names are *global* (``decoder.layers.<global index>...``), so the answer does not depend on
how the worker is split into TP ranks or pipeline stages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
PATTERNS = ("strided", "sequential")


@dataclass(frozen=True)
class FragmentPlan:
    """The split of ``num_layers`` layers into ``num_fragments`` fragments."""

    num_layers: int
    num_fragments: int
    pattern: str = "strided"

    def __post_init__(self):
        if self.pattern not in PATTERNS:
            raise ValueError(f"--diloco-fragment-pattern {self.pattern!r}: expected one of "
                             f"{PATTERNS}")
        if not 1 <= self.num_fragments <= self.num_layers:
            raise ValueError(f"--diloco-fragments ({self.num_fragments}) must be between 1 and "
                             f"--num-layers ({self.num_layers})")

    def fragment_of_layer(self, layer: int) -> int:
        if self.pattern == "strided":
            return layer % self.num_fragments
        # Sequential blocks as even as the division allows (sizes differ by at most one).
        return layer * self.num_fragments // self.num_layers

    def layers_of(self, fragment: int) -> list:
        return [i for i in range(self.num_layers) if self.fragment_of_layer(i) == fragment]

    def fragment_of(self, global_name: str) -> int:
        """Fragment of a parameter by its global name (see ``weights.global_name``)."""
        match = _LAYER.search(global_name)
        if match:
            return self.fragment_of_layer(int(match.group(1)))
        if global_name.startswith("embedding."):
            return self.fragment_of_layer(0)
        if global_name.startswith(("decoder.final_layernorm", "output_layer")):
            return self.fragment_of_layer(self.num_layers - 1)
        raise ValueError(f"parameter {global_name!r} has no fragment: neither a layer, an "
                         "embedding, the final norm nor the output layer")
