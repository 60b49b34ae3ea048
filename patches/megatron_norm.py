"""Sequence parallelism with torch's LayerNorm/RMSNorm (megatron-core 0.16.1, no apex).

Why: without apex, the local GPT spec (``get_gpt_layer_local_spec``, and ``LocalSpecProvider``)
builds its norms with ``transformer.torch_norm.WrappedTorchNorm``, whose ``__new__`` asserts
``not config.sequence_parallel``. Nothing about a torch norm is incompatible with sequence
parallelism: it normalizes each token over the hidden dimension, so running it on a sequence
shard is exactly what megatron's apex ``FusedLayerNorm`` does. The one missing piece is that
each TP rank then sees only its shard, so the norm's weight/bias gradients are partial sums
that must be all-reduced over the TP group. ``FusedLayerNorm`` marks its parameters with
``sequence_parallel=True`` for that; ``finalize_model_grads`` (and any caller-side grad sync)
all-reduces exactly the parameters so marked.

Fix: wrap ``WrappedTorchNorm.__new__``: with sequence parallelism on, build the norm from a
shallow copy of the config with ``sequence_parallel=False`` (the caller's config is never
mutated) and set ``sequence_parallel=True`` on the norm's parameters.

Needed whenever apex is not importable, since that alone makes megatron pick WrappedTorchNorm
for the local spec (Transformer Engine does not change that choice; its own spec uses TENorm).
"""

import copy
import functools

from ._patch import Patch, is_marked, mark

NAME = "megatron_norm"


def _is_needed() -> bool:
    from . import optional

    return not optional.HAVE_APEX


def install() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original_new = WrappedTorchNorm.__new__
    if is_marked(original_new, NAME):
        return

    @functools.wraps(original_new)
    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        config_without_sp = copy.copy(config)
        config_without_sp.sequence_parallel = False
        norm = original_new(cls, config_without_sp, hidden_size, *args, **kwargs)
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
