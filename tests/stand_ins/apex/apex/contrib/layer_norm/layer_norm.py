"""apex.contrib.layer_norm.layer_norm (the persistent kernel), computed by torch."""

import os
import runpy

import torch.nn.functional as F

_ROOT = os.path.join(os.path.dirname(__file__), *[".."] * 4)  # tests/stand_ins
ran = runpy.run_path(os.path.join(_ROOT, "record.py"))["ran"]


class FastLayerNormFN:
    @staticmethod
    def forward(ctx, x, gamma, beta, epsilon, memory_efficient=False):
        raise NotImplementedError

    @staticmethod
    def apply(x, gamma, beta, epsilon, memory_efficient=False):
        ran("apex.FastLayerNormFN")
        return F.layer_norm(x, (x.shape[-1],), gamma, beta, epsilon)
