"""Ladder residual (arXiv 2501.06589): overlap each tensor-parallel all-reduce with compute.

In a standard pre-norm layer every sub-block (attention, MLP) waits for the previous
sub-block's TP all-reduce before it can start. In a ladder layer a sub-block reads a residual
stream that does *not yet* hold the previous sub-block's output; that output's all-reduce is
started asynchronously and waited on one sub-block later, just before it is added::

    wait(h_attn); r += attn_prev; attn = Attn(norm1(r)); h_attn = all_reduce_async(attn)
    wait(h_mlp);  r += mlp_prev;  mlp = MLP(norm2(r));   h_mlp = all_reduce_async(mlp)

and after the last ladder layer of a run both pending outputs are waited on and added (then
the next ordinary layer, or the final norm, sees a complete residual stream).

Where it sits: ``ladder_block_spec`` turns megatron-core's local layer spec into a block spec
(``TransformerBlockSubmodules``) whose ladder layers are ``LadderTransformerLayer`` and whose
other layers are megatron's own ``TransformerLayer``. Megatron's ``TransformerBlock`` and
``GPTModel`` run it unchanged. The row-parallel output projections (attention ``linear_proj``,
MLP ``linear_fc2``) of ladder layers are ``PartialRowParallelLinear``: megatron's
``RowParallelLinear`` minus its synchronous all-reduce, so this module owns the reduction.

The pending outputs of one forward live in a ``LadderChain`` shared by the ladder layers of
one model (through the spec); it is empty between forwards. With TP=1 there is nothing to
wait for and the math is the same as with TP>1.

Pipeline stages: when a ladder run continues across a stage boundary, the stage's last layer
adds the pending attention output (the next layer's first step anyway) and sends the residual
and the reduced MLP output (bias added, dropout not yet) stacked along the sequence dim,
``[2s, b, h]``; the next stage's first layer splits them. Megatron's p2p learns that shape from
its shape exchange (``config.variable_seq_lengths``, switched on by ``ladder_block_spec``).
With hidden dropout 0 this is exactly the single-stage computation; with dropout the masks
are drawn at another point of the generator stream.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

# The layer classes subclass megatron's, so megatron is imported with this module: import it
# where a model is built (config validation can import ``parse_ladder_layers`` lazily).
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.transformer_layer import TransformerLayer

from patches import megatron_row_parallel

FLAG = "--ladder-layers"
SUB_BLOCKS = ("attn", "mlp")


# ---- which layers ------------------------------------------------------------------------------

def parse_ladder_layers(spec: str, num_layers: int) -> Set[int]:
    """0-based global indices of the ladder layers named by ``--ladder-layers SPEC``.

    SPEC is a comma-separated list of ``all``, ``N``, ``A-B`` (inclusive, 0-based),
    ``first:K`` or ``last:K`` (the paper converts the upper half: ``last:L/2``).
    """
    if num_layers < 1:
        raise ValueError(f"{FLAG}: the model has no layers (--num-layers {num_layers})")
    if spec is None or not str(spec).strip():
        raise ValueError(f"{FLAG} needs a value such as 'all', '12-23' or 'last:8', "
                         f"got {spec!r}")
    layers: Set[int] = set()
    for item in str(spec).split(","):
        item = item.strip()
        layers |= _parse_item(item, spec, num_layers)
    return layers


def _parse_item(item: str, spec: str, num_layers: int) -> Set[int]:
    def bad(why: str) -> ValueError:
        return ValueError(f"{FLAG} {spec!r}: {why} (layers are 0..{num_layers - 1}; use "
                          f"'all', 'N', 'A-B', 'first:K' or 'last:K', comma-separated)")

    def number(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise bad(f"{text!r} in {item!r} is not an integer") from None

    if item == "all":
        return set(range(num_layers))
    if not item:
        raise bad("empty item")
    if ":" in item:
        where, count = item.split(":", 1)
        k = number(count)
        if where not in ("first", "last"):
            raise bad(f"{where!r} in {item!r} is neither 'first' nor 'last'")
        if not 1 <= k <= num_layers:
            raise bad(f"{item!r} asks for {k} layers")
        return set(range(k)) if where == "first" else set(range(num_layers - k, num_layers))
    if "-" in item[1:]:
        cut = item.index("-", 1)
        lo, hi = number(item[:cut]), number(item[cut + 1:])
        if lo > hi:
            raise bad(f"range {item!r} is reversed")
    else:
        lo = hi = number(item)
    if lo < 0 or hi >= num_layers:
        raise bad(f"{item!r} is out of range")
    return set(range(lo, hi + 1))


def ladder_layer_set(ladder_residual: bool, ladder_layers: Optional[str],
                     num_layers: int) -> Set[int]:
    """What ``--ladder-residual`` / ``--ladder-layers`` select together (empty: no ladder)."""
    if ladder_residual and ladder_layers:
        raise ValueError(f"--ladder-residual converts every layer; give it or {FLAG} "
                         f"{ladder_layers!r}, not both")
    if ladder_residual:
        return set(range(num_layers))
    return parse_ladder_layers(ladder_layers, num_layers) if ladder_layers else set()


def stage_crossings(ladder: Set[int], num_layers: int, pp: int) -> List[int]:
    """Global layers that start a pipeline stage while continuing a ladder run from the
    previous stage (the pending outputs cross the stage boundary)."""
    if pp <= 1 or num_layers % pp:
        return []
    per_stage = num_layers // pp
    return [s * per_stage for s in range(1, pp)
            if s * per_stage in ladder and s * per_stage - 1 in ladder]


# ---- instrumentation ---------------------------------------------------------------------------

class LadderTrace:
    """Order of events in ladder forwards, for tests: ``(kind, layer, sub_block)`` with kind
    ``compute`` (a sub-block starts), ``issue`` (its all-reduce is started) and ``wait`` (its
    reduced output is waited on, just before the add). ``layer`` is the global 0-based index."""

    def __init__(self):
        self.events: List[Tuple[str, int, str]] = []
        self.completed_at_wait: Dict[Tuple[int, str], Optional[bool]] = {}

    def record(self, kind: str, layer: int, sub: str) -> None:
        self.events.append((kind, layer, sub))

    def position(self, kind: str, layer: int, sub: str) -> int:
        return self.events.index((kind, layer, sub))


# ---- the asynchronous, differentiable all-reduce -------------------------------------------------

class PendingReduce:
    """A sub-block output whose TP all-reduce is in flight; ``wait()`` gives the sum."""

    def __init__(self, layer: int, sub: str, bias: Optional[torch.Tensor]):
        self.layer, self.sub, self.bias = layer, sub, bias
        self.tensor: Optional[torch.Tensor] = None
        self.work = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.tensor

    def is_completed(self) -> Optional[bool]:
        return None if self.work is None else bool(self.work.is_completed())


class _StartAllReduce(torch.autograd.Function):
    """Forward: start ``all_reduce(sum)`` over the TP group, return the buffer it fills.
    Backward: identity, as megatron's reduce-from-tensor-parallel region (the gradient of
    the reduced, replicated output is already the gradient of every partial sum)."""

    @staticmethod
    def forward(ctx, partial, group, pending):
        # A copy: the collective writes into it from gloo's thread while autograd may still
        # hold ``partial``; nobody reads the copy before ``pending.wait()``.
        buffer = partial.clone()
        pending.work = dist.all_reduce(buffer, group=group, async_op=True)
        return buffer

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def all_reduce_async(partial: torch.Tensor, group, pending: PendingReduce) -> PendingReduce:
    if group is None or dist.get_world_size(group) == 1:
        pending.tensor = partial
    else:
        pending.tensor = _StartAllReduce.apply(partial, group, pending)
    return pending


class PartialRowParallelLinear(RowParallelLinear):
    """megatron's ``RowParallelLinear`` returning this rank's partial sum: no all-reduce (the
    ladder layer starts it asynchronously) and the bias handed back, to be added after the
    reduction exactly once, as megatron does. The partial sum comes through the pinned
    adapter ``patches.megatron_row_parallel`` (megatron's private ``_forward_impl``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not (self.input_is_parallel and self.skip_bias_add):
            raise ValueError("ladder residual needs row-parallel output projections with a "
                             "parallel input and the bias returned (megatron's defaults)")
        if self.sequence_parallel:
            raise ValueError("ladder residual with --sequence-parallel is not supported yet")

    def forward(self, input_):
        return megatron_row_parallel.partial_sum(self, input_), self.bias


# ---- the layer ----------------------------------------------------------------------------------

class LadderChain:
    """Pending outputs of the ladder layers of one model during one forward, and an optional
    ``LadderTrace``. Shared by the layers through the spec; empty between forwards."""

    def __init__(self):
        self.pending: Dict[str, PendingReduce] = {}
        self.trace: Optional[LadderTrace] = None

    def record(self, kind: str, layer: int, sub: str) -> None:
        if self.trace is not None:
            self.trace.record(kind, layer, sub)


_ATTENTION_KWARGS = ("inference_context", "rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin",
                     "rotary_pos_cos_sin", "attention_bias", "packed_seq_params",
                     "sequence_len_offset")


class LadderTransformerLayer(TransformerLayer):
    """A megatron ``TransformerLayer`` (same submodules, same parameter names) whose forward
    follows the ladder equations. ``starts_run``: the previous layer is not ladder (nothing
    pending on entry). ``ends_run``: the next layer is not ladder, or this is the model's last
    layer: wait for and add both pending outputs before returning. ``receives`` / ``sends``:
    the run continues from the previous / into the next pipeline stage (see the module
    docstring for the packed ``[2s, b, h]`` hand-over)."""

    def __init__(self, config, submodules, layer_number: int = 1, hidden_dropout=None,
                 pg_collection=None, vp_stage=None, *, chain: LadderChain,
                 starts_run: bool, ends_run: bool, receives: bool = False,
                 sends: bool = False):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         hidden_dropout=hidden_dropout, pg_collection=pg_collection,
                         vp_stage=vp_stage)
        if config.sequence_parallel:
            raise ValueError("ladder residual with --sequence-parallel is not supported yet")
        if config.recompute_granularity == "full":
            # A recomputed chunk would re-issue its all-reduces without the pending outputs
            # of the layer before the chunk.
            raise ValueError("ladder residual with full activation recomputation is not "
                             "supported")
        self.ladder_chain = chain
        self.starts_run, self.ends_run = starts_run, ends_run
        self.receives, self.sends = receives, sends

    @property
    def global_index(self) -> int:
        return self.layer_number - 1  # megatron's layer_number is global and 1-based

    def forward(self, hidden_states, attention_mask=None, context=None, context_mask=None,
                padding_mask=None, **kwargs):
        if context is not None:
            raise ValueError("ladder residual has no cross-attention")
        kwargs.pop("dynamic_inference_decode_only", None)
        attn_kwargs = {k: kwargs[k] for k in _ATTENTION_KWARGS if k in kwargs}
        chain = self.ladder_chain
        if self.starts_run or self.receives:
            chain.pending.clear()  # a failed earlier forward must not leak into this one
        r = hidden_states
        if self.receives:
            r, mlp_out = self._unpack(hidden_states)
            chain.pending["mlp"] = PendingReduce(self.global_index - 1, "mlp", None)
            chain.pending["mlp"].tensor = mlp_out

        r = self._add_pending(r, "attn")
        chain.record("compute", self.global_index, "attn")
        out, bias = self.self_attention(self.input_layernorm(r), attention_mask=attention_mask,
                                        **attn_kwargs)
        self._issue(out, bias, "attn")

        r = self._add_pending(r, "mlp")
        chain.record("compute", self.global_index, "mlp")
        out, bias = self.mlp(self.pre_mlp_layernorm(r))
        self._issue(out, bias, "mlp")

        if self.ends_run:
            r = self._add_pending(r, "attn")
            r = self._add_pending(r, "mlp")
        elif self.sends:
            r = self._pack(self._add_pending(r, "attn"), chain.pending.pop("mlp"))
        return r, context

    def _pack(self, residual, mlp: PendingReduce):
        """Residual and the reduced MLP output (+ bias) for the next stage, ``[2s, b, h]``."""
        out = mlp.wait()
        self.ladder_chain.record("wait", mlp.layer, "mlp")
        if mlp.bias is not None:
            out = out + mlp.bias
        return torch.cat([residual, out.to(residual.dtype)], dim=0)

    def _unpack(self, packed):
        if packed.shape[0] % 2:
            raise ValueError(f"ladder layer {self.global_index} expected the previous stage's "
                             f"[2s, b, h] hand-over, got shape {tuple(packed.shape)}")
        return packed.chunk(2, dim=0)

    def _issue(self, partial, bias, sub: str) -> None:
        pending = PendingReduce(self.global_index, sub, bias)
        self.ladder_chain.pending[sub] = all_reduce_async(partial, self.tp_group, pending)
        self.ladder_chain.record("issue", self.global_index, sub)

    def _add_pending(self, residual, sub: str):
        pending = self.ladder_chain.pending.pop(sub, None)
        if pending is None:
            return residual
        chain = self.ladder_chain
        if chain.trace is not None:
            chain.trace.completed_at_wait[(pending.layer, sub)] = pending.is_completed()
        reduced = pending.wait()
        chain.record("wait", pending.layer, sub)
        bda = self.self_attn_bda if sub == "attn" else self.mlp_bda
        return bda(self.training, self.config.bias_dropout_fusion)(
            (reduced, pending.bias), residual, self.hidden_dropout)


# ---- the spec -----------------------------------------------------------------------------------

def _ladder_layer_spec(base, chain: LadderChain, **roles):
    """``base`` (megatron's local layer spec) with the ladder layer class and partial-sum
    output projections; every other submodule is megatron's own."""
    sub = base.submodules
    attn, mlp = sub.self_attention, sub.mlp
    for name, linear in (("self_attention.linear_proj", attn.submodules.linear_proj),
                         ("mlp.linear_fc2", mlp.submodules.linear_fc2)):
        if linear is not RowParallelLinear:
            raise ValueError(f"ladder residual needs megatron's local spec ({name} is "
                             f"{getattr(linear, '__name__', linear)}); use "
                             f"--transformer-impl local")
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(
        attn.submodules, linear_proj=PartialRowParallelLinear))
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(
        mlp.submodules, linear_fc2=PartialRowParallelLinear))
    return dataclasses.replace(
        base, module=LadderTransformerLayer,
        submodules=dataclasses.replace(sub, self_attention=attn, mlp=mlp),
        params={**(base.params or {}), "chain": chain, **roles})


def ladder_block_spec(config, layer_spec, ladder_layers: Set[int], pp_rank: int = 0,
                      trace: Optional[LadderTrace] = None, final_norm=None):
    """Block spec for this pipeline stage: ladder layers where ``ladder_layers`` (0-based
    global indices) says, megatron's ``layer_spec`` elsewhere. Pass it to ``GPTModel`` as
    ``transformer_layer_spec``. Each call makes a fresh ``LadderChain``: build one model per
    spec. When a ladder run crosses a pipeline stage boundary this switches on
    ``config.variable_seq_lengths`` (in place: the p2p communicator reads the model's config),
    since that stage hands over ``[2s, b, h]``."""
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    final_norm = final_norm or LayerNormImpl
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pp = config.pipeline_model_parallel_size
    if config.num_layers_in_first_pipeline_stage or config.num_layers_in_last_pipeline_stage:
        raise ValueError("ladder residual assumes evenly split pipeline stages")
    if stage_crossings(ladder_layers, config.num_layers, pp):
        config.variable_seq_lengths = True
    last = config.num_layers - 1
    count = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=None, pp_rank=pp_rank)
    chain = LadderChain()
    chain.trace = trace
    specs = []
    for i in range(offset, offset + count):
        if i not in ladder_layers:
            specs.append(layer_spec)
            continue
        stage_first, stage_last = i == offset, i == offset + count - 1
        continues_in, continues_out = i - 1 in ladder_layers, i + 1 in ladder_layers
        specs.append(_ladder_layer_spec(
            layer_spec, chain,
            starts_run=not continues_in, receives=stage_first and continues_in,
            ends_run=i == last or not continues_out,
            sends=stage_last and continues_out and i != last))
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm)

