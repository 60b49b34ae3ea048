"""Torch norms that do what apex's FusedLayerNorm does (megatron-core 0.16.1).

Why: the model's norms are torch's ``transformer.torch_norm.WrappedTorchNorm`` wherever apex's
fused LayerNorm is not used (``model.norm_impl``: RMSNorm models, and every model without
apex), and its ``__new__`` asserts ``not config.sequence_parallel``,
``not config.layernorm_zero_centered_gamma`` and ``not config.persist_layer_norm`` (set where
apex's persistent kernel imports, for apex's own norm). None is incompatible with a torch
norm:

* Sequence parallelism: a norm normalizes each token over the hidden dimension, so running it
  on a sequence shard is exactly what megatron's apex ``FusedLayerNorm`` does. The one
  missing piece is that each TP rank then sees only its shard, so the norm's weight/bias
  gradients are partial sums that must be all-reduced over the TP group. ``FusedLayerNorm``
  marks its parameters with ``sequence_parallel=True`` for that; ``finalize_model_grads`` (and
  any caller-side grad sync) all-reduces exactly the parameters so marked.
* Zero-centred weights (Megatron-LM's ``--apply-layernorm-1p``, used by its Llama 3 script):
  the norm scales by ``weight + 1`` and its weight starts at 0, as ``FusedLayerNorm`` and
  Transformer Engine's norms do with ``zero_centered_gamma``.

* The persistent kernel is apex's; a torch norm simply does not use it.

Fix: wrap ``WrappedTorchNorm.__new__``: build the norm from a shallow copy of the config with
the three switched off (the caller's config is never mutated); with sequence parallelism set
``sequence_parallel=True`` on the norm's parameters; with zero-centred weights give the norm
a subclass whose forward adds 1 to the weight, and zero the weight.

Needed always: with or without apex some model's norms are torch's.
"""

import copy
import functools

from ._patch import Patch, is_marked, mark

NAME = "megatron_norm"


def _is_needed() -> bool:
    return True


def _zero_centered(norm):
    """The same norm scaling by ``weight + 1``, weight zeroed."""
    import torch
    import torch.nn.functional as F

    class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)

    class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
        def forward(self, x):
            return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)

    for base, cls in ((torch.nn.LayerNorm, ZeroCenteredLayerNorm),
                      (torch.nn.RMSNorm, ZeroCenteredRMSNorm)):
        if type(norm) is base:
            norm.__class__ = cls
            with torch.no_grad():
                norm.weight.zero_()
            return norm
    raise ValueError(f"--apply-layernorm-1p: no zero-centred form of {type(norm).__name__}")


def install() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original_new = WrappedTorchNorm.__new__
    if is_marked(original_new, NAME):
        return

    @functools.wraps(original_new)
    def __new__(cls, config, hidden_size, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        zero_centered = config.layernorm_zero_centered_gamma
        if not (sequence_parallel or zero_centered or config.persist_layer_norm):
            return original_new(cls, config, hidden_size, *args, **kwargs)
        plain_config = copy.copy(config)
        plain_config.sequence_parallel = False
        plain_config.layernorm_zero_centered_gamma = False
        plain_config.persist_layer_norm = False
        norm = original_new(cls, plain_config, hidden_size, *args, **kwargs)
        if zero_centered:
            norm = _zero_centered(norm)
        if sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = staticmethod(mark(__new__, NAME))


PATCH = Patch(
    name=NAME,
    package="megatron-core",
    version="0.16.1",
    is_needed=_is_needed,
    install=install,
)
