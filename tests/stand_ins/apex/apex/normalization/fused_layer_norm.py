"""apex.normalization.fused_layer_norm as megatron-core calls it, computed by torch."""

import os
import runpy

import torch
import torch.nn.functional as F

_ROOT = os.path.join(os.path.dirname(__file__), *[".."] * 3)  # tests/stand_ins
ran = runpy.run_path(os.path.join(_ROOT, "record.py"))["ran"]


class FusedLayerNormAffineFunction:
    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        raise NotImplementedError  # only the signature is read (megatron inspects it)

    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps, memory_efficient=False):
        ran("apex.FusedLayerNormAffineFunction")
        return F.layer_norm(input, tuple(normalized_shape), weight, bias, eps)


class FusedRMSNormAffineFunction:
    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False):
        raise NotImplementedError

    @staticmethod
    def apply(input, weight, normalized_shape, eps, memory_efficient=False):
        ran("apex.FusedRMSNormAffineFunction")
        return F.rms_norm(input, tuple(normalized_shape), weight, eps)


class FusedLayerNorm(torch.nn.LayerNorm):
    pass
