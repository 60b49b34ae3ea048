"""Builds one worker's slice of the GPT: megatron-core ``GPTModel`` with explicit groups.

Sits between the topology (which stage and TP rank this is) and the engine (which wraps the
model in DeepSpeed). ``layer_spec`` is the seam where later layer kinds (Ulysses attention,
Ladder residual) plug in; nothing here forks Megatron's files.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ..config import ModelConfig, ParallelConfig, PrecisionConfig, TransformerEngineConfig
from ..config.shape import padded_vocab_size
from ..parallel.topology import Topology

log = logging.getLogger(__name__)


def have_transformer_engine() -> bool:
    from patches.optional import have_te

    return have_te()


def resolve_transformer_impl(requested: str) -> str:
    """``auto`` is megatron-core's local layers: Transformer Engine's have not run in this
    project's tests, so they are opt-in (``transformer_engine``: the package and a GPU)."""
    if requested != "transformer_engine":
        return "local"
    if not (have_transformer_engine() and torch.cuda.is_available()):
        raise ValueError(
            "--transformer-impl transformer_engine needs the transformer_engine package and a "
            "GPU; use --transformer-impl local (or auto) on this machine")
    return "transformer_engine"


def transformer_impl_note(requested: str) -> str:
    """Which layers run and why, said once at start."""
    if requested == "transformer_engine":
        return ("--transformer-impl transformer_engine: Transformer Engine's layers, which have "
                "not run in this project's tests; their checkpoints use its parameter names "
                "(local-layer runs and the HF converters read megatron-core's local names)")
    why = "asked for" if requested == "local" else (
        "Transformer Engine imports, but its layers are opt-in (--transformer-impl "
        "transformer_engine)" if have_transformer_engine() else
        "Transformer Engine does not import")
    return f"--transformer-impl {requested}: megatron-core's local layers ({why})"


def norm_impl(model_cfg: ModelConfig, transformer_engine: bool):
    """The norm module of every norm of the model, chosen here rather than by which packages
    megatron-core found importable (its local spec takes apex's ``FusedLayerNorm`` whenever
    apex imports, which refuses RMSNorm; its block's final norm is Transformer Engine's
    whenever that imports): Transformer Engine's norm in its layers; apex's fused LayerNorm
    where the norm is a LayerNorm and apex's kernels import; torch's elsewhere
    (``patches.megatron_norm`` lets it take sequence parallelism and zero-centred weights)."""
    from patches.optional import have_apex_layer_norm

    if transformer_engine:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    if model_cfg.normalization == "LayerNorm" and have_apex_layer_norm():
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

        return FusedLayerNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


# What --attention-backend auto runs on megatron-core's local layers: the fused attention,
# faster than the unfused one at every length, precision and dropout measured on the CPU
# (1.5-7.8x without dropout at 512-4096 tokens, 1.1-1.35x with it) and without dropout
# holding no O(s^2) scores (benchmarks/attention.py; docs/RESULTS.md, "Core attention").
AUTO_ATTENTION = "sdpa"
_LOCAL_ATTENTION = {"flash": "sdpa", "fused": "sdpa", "unfused": "unfused", "local": "unfused",
                    "auto": AUTO_ATTENTION}


def local_attention(backend: str) -> str:
    """The core attention of megatron-core's local layers for Megatron's ``--attention-backend``
    name: ``sdpa`` (``attention.SDPAttention``) or ``unfused`` (``DotProductAttention``)."""
    return _LOCAL_ATTENTION[backend]


def core_attention_class(backend: str):
    if local_attention(backend) == "sdpa":
        from .attention import SDPAttention

        return SDPAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


def te_layers(model_cfg: ModelConfig, sp: int = 1) -> bool:
    """Whether Transformer Engine's layer spec runs: not under Ulysses or Ladder residual
    (both build on the local spec), nor with ``--attention-backend local`` (megatron-core's
    own attention, as Megatron-LM's ``local`` asks), and only where TE can run."""
    if sp > 1 or model_cfg.ladder_residual or model_cfg.ladder_layers or \
            model_cfg.attention_backend == "local":
        return False
    return resolve_transformer_impl(model_cfg.transformer_impl) == "transformer_engine"


def loader_makes_mask(model_cfg: ModelConfig, sp: int = 1) -> bool:
    """Whether the data loader makes the ``[s, s]`` causal mask: not for torch's fused attention,
    which applies the causal mask in its kernel. The loader's mask is always the plain causal
    one (no per-document reset), and given it the kernel would take its masked path (no flash
    kernel on a GPU, no skipped upper half anywhere)."""
    return te_layers(model_cfg, sp) or local_attention(model_cfg.attention_backend) != "sdpa"


def describe_attention(model_cfg: ModelConfig, sp: int = 1) -> str:
    """Which core attention runs and why, for the run's start."""
    backend = model_cfg.attention_backend
    if te_layers(model_cfg, sp):
        return f"Transformer Engine's (--attention-backend {backend})"
    if local_attention(backend) == "unfused":
        return f"megatron-core's unfused DotProductAttention (--attention-backend {backend})"
    why = ("auto: faster than the unfused one and no O(s^2) scores, docs/RESULTS.md"
           if backend == "auto" else f"--attention-backend {backend}")
    return f"torch's scaled_dot_product_attention ({why})"


def layer_spec(model_cfg: ModelConfig, sp_group=None):
    """The transformer layer spec: the one place that chooses layer implementations.

    Ulysses (``sp_group`` of more than one rank) wraps the local spec's core attention; Ladder
    residual builds on the local spec too, so both take it whatever ``--transformer-impl``
    asks. The local spec's core attention is the one ``--attention-backend`` names, its
    norms ``norm_impl``'s."""
    from megatron.core.models.gpt import gpt_layer_specs

    sp = sp_group.size() if sp_group is not None else 1
    if te_layers(model_cfg, sp):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    core_attention = core_attention_class(model_cfg.attention_backend)
    if sp > 1:
        from .ulysses import ulysses_layer_spec

        spec = ulysses_layer_spec(sp_group, model_cfg.normalization, core_attention)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=model_cfg.normalization)
        spec.submodules.self_attention.submodules.core_attention = core_attention
    norm = norm_impl(model_cfg, transformer_engine=False)
    spec.submodules.input_layernorm = norm
    spec.submodules.pre_mlp_layernorm = norm
    return spec


def block_spec(config, model_cfg: ModelConfig, spec, pp_rank: int, sp: int = 1):
    """This pipeline stage's block: its layers' specs and the final norm (``norm_impl``'s),
    as megatron-core's ``TransformerBlock`` takes them; Ladder residual's where asked."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    final_norm = norm_impl(model_cfg, transformer_engine=te_layers(model_cfg, sp))
    if model_cfg.ladder_residual or model_cfg.ladder_layers:
        from .ladder import ladder_block_spec, ladder_layer_set

        ladder = ladder_layer_set(model_cfg.ladder_residual, model_cfg.ladder_layers,
                                  model_cfg.num_layers)
        return ladder_block_spec(config, spec, ladder, pp_rank=pp_rank, final_norm=final_norm)
    layers = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    specs = [spec] * layers
    if model_cfg.moe:
        from . import moe

        te = te_layers(model_cfg, sp)
        specs = moe.layer_specs(spec, model_cfg, pp_rank * layers, layers, te,
                                norm_impl(model_cfg, transformer_engine=True) if te else None)
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm)


def recompute_settings(model_cfg: ModelConfig) -> dict:
    """megatron-core's activation recompute, from Megatron's flags (validated)."""
    if model_cfg.recompute_granularity is None:
        return {}
    settings = {"recompute_granularity": model_cfg.recompute_granularity,
                "recompute_modules": model_cfg.recompute_modules}
    if model_cfg.recompute_granularity == "full":
        settings.update(recompute_method=model_cfg.recompute_method,
                        recompute_num_layers=model_cfg.recompute_num_layers or 1)
    return settings


def transformer_engine_settings(model_cfg: ModelConfig, sp: int,
                                te_cfg: Optional[TransformerEngineConfig]) -> dict:
    """TransformerConfig fields of Transformer Engine's layers (validated to have TE and a GPU):
    its attention kernels, FP8. megatron-core's model sets TE's kernel switches (NVTE_*) from
    ``attention_backend``; on the local layers it stays at megatron-core's default."""
    if not te_layers(model_cfg, sp):
        return {}
    from megatron.core.transformer.enums import AttnBackend

    settings = {"attention_backend": AttnBackend[model_cfg.attention_backend]}
    if te_cfg is None:
        return settings
    if te_cfg.fp8_format:
        settings.update(fp8=te_cfg.fp8_format, fp8_recipe=te_cfg.fp8_recipe,
                        fp8_margin=te_cfg.fp8_margin,
                        fp8_amax_history_len=te_cfg.fp8_amax_history_len,
                        fp8_amax_compute_algo=te_cfg.fp8_amax_compute_algo)
    return settings


def transformer_config(model_cfg: ModelConfig, parallel_cfg: ParallelConfig,
                       te_cfg: Optional[TransformerEngineConfig] = None,
                       precision: Optional[PrecisionConfig] = None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    import torch.nn.functional as F

    precision = precision or PrecisionConfig()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision.dtype_name,
                                                                 torch.float32)
    on_gpu = torch.cuda.is_available()
    from patches.optional import have_apex_persistent_layer_norm, have_fused_softmax

    from . import moe

    return TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.query_groups(),
        kv_channels=model_cfg.kv_channels,
        ffn_hidden_size=model_cfg.ffn_size(),
        gated_linear_unit=model_cfg.swiglu,
        activation_func=F.silu if model_cfg.swiglu else F.gelu,
        normalization=model_cfg.normalization,
        layernorm_epsilon=model_cfg.norm_epsilon,
        layernorm_zero_centered_gamma=model_cfg.apply_layernorm_1p,
        add_bias_linear=not model_cfg.disable_bias_linear,
        hidden_dropout=model_cfg.hidden_dropout,
        attention_dropout=model_cfg.attention_dropout,
        init_method_std=model_cfg.init_method_std,
        tensor_model_parallel_size=parallel_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel_cfg.pipeline_model_parallel_size,
        sequence_parallel=parallel_cfg.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision.bf16,
        fp16=precision.fp16,
        # Deterministic CPU initialisation: the same weights whatever the TP layout, which
        # is what lets TP=2 be compared with TP=1 exactly.
        use_cpu_initialization=True,
        # Fused kernels exist only for CUDA; on CPU the unfused paths compute the same thing.
        gradient_accumulation_fusion=False,
        # As Megatron-LM: the fused bias-GeLU needs a bias (bias-SwiGLU takes none).
        bias_activation_fusion=on_gpu and (model_cfg.swiglu or not model_cfg.disable_bias_linear),
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu and have_fused_softmax(),
        # apex's persistent layer norm kernel, for apex's fused LayerNorm (``norm_impl``);
        # the torch norm leaves it alone (``patches.megatron_norm``).
        persist_layer_norm=on_gpu and have_apex_persistent_layer_norm(),
        apply_rope_fusion=False,
        **recompute_settings(model_cfg),
        **moe.transformer_settings(model_cfg, parallel_cfg),
        **transformer_engine_settings(model_cfg,
                                      parallel_cfg.ds_sequence_parallel_size, te_cfg),
    )


def build_model(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, topology: Topology,
                vocab_size: int, te_cfg: Optional[TransformerEngineConfig] = None,
                precision: Optional[PrecisionConfig] = None):
    """This rank's pipeline stage of the GPT, its TP shard, on this rank's device."""
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(model_cfg, parallel_cfg, te_cfg, precision)
    spec = block_spec(config, model_cfg, layer_spec(model_cfg, topology.groups.get("sp")),
                      topology.pp_rank, topology.layout.sp)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(vocab_size, model_cfg.make_vocab_size_divisible_by,
                                     parallel_cfg.tensor_model_parallel_size),
        max_sequence_length=model_cfg.max_position_embeddings or model_cfg.seq_length,
        pre_process=topology.is_first_stage,
        post_process=topology.is_last_stage,
        share_embeddings_and_output_weights=not model_cfg.untie_embeddings_and_output_weights,
        position_embedding_type=model_cfg.position_embedding_type,
        rotary_percent=model_cfg.rotary_percent,
        rotary_base=model_cfg.rotary_base,
        rope_scaling=model_cfg.use_rope_scaling,
        rope_scaling_factor=model_cfg.rope_scaling_factor,
        pg_collection=topology.pg_collection(),
    )
    if model_cfg.moe and not model_cfg.disable_bias_linear:
        from patches.megatron_moe import unshared_expert_outputs

        unshared_expert_outputs(model)
    if topology.layout.sp > 1 and model_cfg.position_embedding_type == "rope":
        from .ulysses import offset_rotary_for_sequence_parallel

        offset_rotary_for_sequence_parallel(model, topology.coords["sp"])
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
