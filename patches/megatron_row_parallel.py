"""Adapter: megatron-core's ``RowParallelLinear`` up to its partial sum (megatron-core 0.16.1;
not a patch, nothing upstream is changed).

The ladder residual (``megatron_streaming.worker.ladder``) starts a row-parallel layer's TP
all-reduce itself, asynchronously, so it needs the layer's output before that reduction: this
rank's ``input @ weight_shard^T``. ``RowParallelLinear.forward`` computes it with the private
``_forward_impl`` (the linear with gradient-accumulation fusion, or the frozen-weight one) and
reduces right after; ``partial_sum`` calls the same ``_forward_impl`` with the arguments
``forward`` passes for a parallel input without sequence parallelism, and stops there. The
method is private and its arguments release-specific: another megatron-core version is
refused.
"""

from ._pinning import require_version_once

NAME = "megatron_row_parallel"
PACKAGE, VERSION = "megatron-core", "0.16.1"


def partial_sum(linear, input_):
    """This TP rank's partial sum of the row-parallel ``linear`` on its (already split)
    ``input_``: no bias, no all-reduce; the input's gradient is this rank's own, as in
    megatron's forward (its reduction region passes gradients through)."""
    require_version_once(PACKAGE, VERSION, NAME)
    return linear._forward_impl(
        input=input_, weight=linear.weight, bias=None,
        gradient_accumulation_fusion=linear.gradient_accumulation_fusion,
        allreduce_dgrad=False, sequence_parallel=False, tp_group=None,
        grad_output_buffer=None)
