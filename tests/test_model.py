"""Model building pieces that need no processes: optional packages, vocab, initialisation."""

import pytest
import torch

from megatron_streaming.worker import model, weights
from megatron_streaming.config import ModelConfig, shape


def test_transformer_engine_is_optional(monkeypatch):
    monkeypatch.setattr(model, "have_transformer_engine", lambda: False)
    assert model.resolve_transformer_impl("auto") == "local"
    assert model.resolve_transformer_impl("local") == "local"
    with pytest.raises(ValueError, match="--transformer-impl transformer_engine"):
        model.resolve_transformer_impl("transformer_engine")
    assert "does not import" in model.transformer_impl_note("auto")
    # Importable, with or without a GPU: still the local spec unless asked for (its layers
    # have not run here), and the run says why.
    monkeypatch.setattr(model, "have_transformer_engine", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert model.resolve_transformer_impl("auto") == "local"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert model.resolve_transformer_impl("auto") == "local"
    assert "opt-in (--transformer-impl transformer_engine)" in \
        model.transformer_impl_note("auto")
    # --help says the same (it once said auto meant Transformer Engine on a GPU).
    from megatron_streaming.cli.arguments import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "megatron-core's local spec (auto, local), or Transformer Engine's " \
        "(transformer_engine: opt-in" in text
    # A flag on by default: its help once, on the positive form; the negative one names it.
    assert "--no-diloco-sync Turns --diloco-sync off. --diloco-sync (on by default) Run the " \
        "Streaming DiLoCo sync." in text
    assert model.resolve_transformer_impl("transformer_engine") == "transformer_engine"
    assert "not run in this project's tests" in \
        model.transformer_impl_note("transformer_engine")


def test_local_spec_falls_back_to_torch_norm_without_apex():
    import patches
    from patches import optional

    spec = model.layer_spec(ModelConfig(transformer_impl="local"))
    norm = spec.submodules.input_layernorm
    if optional.have_apex():
        pytest.skip("apex is installed: megatron uses its fused norm")
    assert norm.__name__ == "WrappedTorchNorm"
    assert "megatron_norm" in patches.apply()


@pytest.mark.parametrize("swiglu", [False, True])
def test_gpu_settings_build_a_layer_without_apex_or_biases(monkeypatch, swiglu):
    """On a GPU the fused paths are asked for; without apex (the torch norm stands in) and
    with --disable-bias-linear, megatron must still build a layer: no persistent layer norm,
    no fused bias-GeLU without a bias (as Megatron-LM's own argument checks decide), and no
    fused softmax without Megatron-LM's kernels."""
    import patches
    from megatron.core.transformer.spec_utils import build_module
    from patches import optional

    from megatron_streaming.config import ParallelConfig

    if optional.have_apex():
        pytest.skip("apex is installed: its persistent layer norm is allowed")
    patches.apply()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                      disable_bias_linear=True, swiglu=swiglu, transformer_impl="local")
    config = model.transformer_config(cfg, ParallelConfig())
    assert config.bias_dropout_fusion
    assert config.masked_softmax_fusion == optional.have_fused_softmax()
    assert config.bias_activation_fusion == swiglu and not config.persist_layer_norm
    spec = model.layer_spec(ModelConfig(transformer_impl="local"))
    build_module(spec.submodules.input_layernorm, config=config, hidden_size=32,
                 eps=config.layernorm_epsilon)


def test_forward_step_moves_the_loaders_batch_to_the_gpu(monkeypatch):
    """The loader builds batches on the CPU; on a GPU the model gets them on the GPU ("meta"
    stands in for CUDA here)."""
    from megatron_streaming.worker import engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, non_blocking=False: self.to("meta"))
    batch = {"tokens": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 4),
             "position_ids": torch.zeros(2, 4, dtype=torch.long), "loss_mask": torch.ones(2, 4)}
    seen = {}

    def forward(tokens, position_ids, attention_mask, labels):
        seen.update(tokens=tokens, position_ids=position_ids, labels=labels)
        return torch.zeros(2, 4)

    engine._forward_step(forward, None, iter([batch]), None)
    assert {k: v.device.type for k, v in seen.items()} == dict.fromkeys(seen, "meta")


def test_padded_vocab_is_a_multiple_of_divisor_times_tp():
    assert shape.padded_vocab_size(1000, 128, 1) == 1024
    assert shape.padded_vocab_size(1000, 128, 2) == 1024
    assert shape.padded_vocab_size(1025, 128, 4) == 1536


def test_global_names_shift_by_the_stage_offset():
    assert weights.global_name("decoder.layers.0.mlp.linear_fc1.weight", 4) == \
        "decoder.layers.4.mlp.linear_fc1.weight"
    assert weights.global_name("embedding.word_embeddings.weight", 4) == \
        "embedding.word_embeddings.weight"


def test_initial_values_follow_megatron_scheme():
    std, layers = 0.02, 8
    w = weights.init_value("decoder.layers.1.mlp.linear_fc2.weight", [256, 256], std, layers, 1)
    assert w.std().item() == pytest.approx(std / (2 * layers) ** 0.5, rel=0.05)
    w = weights.init_value("decoder.layers.1.mlp.linear_fc1.weight", [256, 256], std, layers, 1)
    assert w.std().item() == pytest.approx(std, rel=0.05)
    assert torch.equal(weights.init_value("decoder.final_layernorm.weight", [4], std, layers, 1),
                       torch.ones(4))
    assert torch.equal(weights.init_value("decoder.layers.0.self_attention.linear_qkv.bias",
                                          [4], std, layers, 1), torch.zeros(4))
    # Same name and seed, same draw; another layer, another draw.
    a = weights.init_value("decoder.layers.1.mlp.linear_fc1.weight", [4, 4], std, layers, 1)
    b = weights.init_value("decoder.layers.1.mlp.linear_fc1.weight", [4, 4], std, layers, 1)
    c = weights.init_value("decoder.layers.2.mlp.linear_fc1.weight", [4, 4], std, layers, 1)
    assert torch.equal(a, b) and not torch.equal(a, c)
