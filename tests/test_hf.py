"""Hugging Face conversion: the converted model computes the same logits, both ways.

Export: our megatron-core GPT (TP1 PP1, in this process) and the transformers model built
from ``to_hf``'s config and state dict give the same logits over the real vocabulary.
Import: a randomly initialised transformers model and our model rebuilt from ``from_hf``'s
flags and parameters do too, and exporting the import gives back the very same tensors.
Every parameter is perturbed first, so norm weights and biases (1 and 0 after either
initialisation) are really checked. Tiny models, no downloads.
"""

import json

import pytest
import torch

from megatron_streaming.checkpoint import hf
from megatron_streaming.cli.arguments import parse_args, validate

VOCAB, SEQ = 200, 16  # 200 pads to 256: the padding rows are exercised
TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
        "4", "--seq-length", str(SEQ), "--hidden-dropout", "0", "--attention-dropout", "0",
        "--transformer-impl", "local"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear"]
ATOL = 1e-5


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def _perturb(named_params, seed):
    gen = torch.Generator().manual_seed(seed)
    for _, p in named_params:
        p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def _our_model(topo, flags, vocab=VOCAB):
    """Our model of ``flags`` (validated as pretrain_gpt.py would) with initialised and then
    perturbed weights, in eval mode."""
    from megatron_streaming.parallel import distributed
    from megatron_streaming.worker import weights
    from megatron_streaming.worker.model import build_model

    cfg = parse_args([*TINY, *flags])
    validate(cfg, 1)
    m = cfg.model
    distributed.seed_everything(1, 0)
    model = build_model(m, cfg.parallel, topo, vocab, None, cfg.precision)
    weights.initialize_weights(
        model, seed=3, std=m.init_method_std, num_layers=m.num_layers, layer_offset=0,
        tp_rank=0, tp_size=1, gated_mlp=m.swiglu, zero_centered_norms=m.apply_layernorm_1p,
        tied_output_name=None if m.untie_embeddings_and_output_weights else
        "embedding.word_embeddings.weight")
    _perturb(model.named_parameters(), 4)
    return cfg.model, model.eval()


@torch.no_grad()
def _our_logits(model, tokens):
    # megatron-core's GPTModel returns [batch, seq, padded vocab] when given no labels.
    logits = model(tokens, torch.arange(SEQ).repeat(tokens.shape[0], 1), None)
    assert logits.shape[:2] == tokens.shape
    return logits[..., :VOCAB]


@torch.no_grad()
def _hf_logits(config, state):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True)
    return model.eval()(_tokens()).logits


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


EXPORTS = {
    "llama_gqa_untied": [*LLAMA, "--group-query-attention", "--num-query-groups", "2",
                         "--rotary-base", "500000", "--untie-embeddings-and-output-weights"],
    "llama_tied_1p_scaled_biases": ["--swiglu", "--normalization", "RMSNorm",
                                    "--position-embedding-type", "rope", "--apply-layernorm-1p",
                                    "--use-rope-scaling", "--rope-scaling-factor", "8",
                                    "--norm-epsilon", "1e-6"],
    # Mixtral: every MLP four SwiGLU experts, top-2, grouped-query attention.
    "mixtral": [*LLAMA, "--num-experts", "4", "--moe-router-topk", "2",
                "--group-query-attention", "--num-query-groups", "2",
                "--untie-embeddings-and-output-weights"],
    "gpt2_default": [],
    "gpt2_untied_no_bias_1p": ["--untie-embeddings-and-output-weights", "--disable-bias-linear",
                               "--apply-layernorm-1p", "--ffn-hidden-size", "96"],
}


@pytest.mark.parametrize("case", list(EXPORTS))
def test_export_gives_the_same_logits(megatron_world, case):
    model_cfg, model = _our_model(megatron_world, EXPORTS[case])
    config, state = hf.to_hf(model_cfg, _params(model), VOCAB)
    assert config.model_type == ("gpt2" if case.startswith("gpt2") else
                                 "mixtral" if case == "mixtral" else "llama")
    assert config.vocab_size == VOCAB
    ours = _our_logits(model, _tokens())
    diff = (_hf_logits(config, state) - ours).abs().max().item()
    print(f"{case}: max |logit difference| {diff:.2e}")
    assert diff < ATOL
    if model_cfg.use_rope_scaling:  # the comparison does see the RoPE frequencies
        config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        assert (_hf_logits(config, state) - ours).abs().max().item() > 10 * ATOL


def test_mixtral_files_round_trip(megatron_world, tmp_path):
    """What transformers writes for Mixtral (``block_sparse_moe.experts.e.w1/w3/w2``) reads
    back into the very tensors exported."""
    model_cfg, model = _our_model(megatron_world, EXPORTS["mixtral"])
    params = _params(model)
    hf.save_hf(model_cfg, params, VOCAB, str(tmp_path))
    flags, loaded = hf.load_hf(str(tmp_path))
    back = parse_args([*TINY, *flags]).model
    assert (hf.architecture(back), back.num_experts, back.moe_router_topk) == ("mixtral", 4, 2)
    assert loaded.keys() == params.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, params[name][:VOCAB] if "word_emb" in name or
                           "output_layer" in name else params[name]), name


def test_save_and_load_round_trip(megatron_world, tmp_path):
    from safetensors import safe_open

    model_cfg, model = _our_model(megatron_world, EXPORTS["llama_gqa_untied"])
    params = _params(model)
    hf.save_hf(model_cfg, params, VOCAB, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    flags, loaded = hf.load_hf(str(tmp_path))
    back = parse_args([*TINY, *flags]).model
    assert hf.architecture(back) == "llama"
    assert (back.query_groups(), back.rotary_base) == (2, 500000)
    assert loaded.keys() == params.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, params[name][:VOCAB] if "word_emb" in name or
                           "output_layer" in name else params[name]), name
    # Tied GPT-2 in bf16: one embedding tensor on disk, the dtype asked for.
    gpt_cfg, gpt = _our_model(megatron_world, [])
    hf.save_hf(gpt_cfg, _params(gpt), VOCAB, str(tmp_path / "bf16"), dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert f.get_tensor("transformer.wte.weight").dtype == torch.bfloat16
    flags, loaded = hf.load_hf(str(tmp_path / "bf16"))
    assert loaded["embedding.word_embeddings.weight"].dtype == torch.float32
    assert "output_layer.weight" not in loaded


def _llama_config(**extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, rms_norm_eps=1e-5, **extra)


def _mixtral_config(**extra):
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, rms_norm_eps=1e-5, num_local_experts=4,
                         num_experts_per_tok=2, **extra)


def _gpt2_config(**extra):
    from transformers import GPT2Config

    return GPT2Config(**{"vocab_size": VOCAB, "n_positions": SEQ, "n_embd": 64, "n_layer": 2,
                         "n_head": 4, "activation_function": "gelu", "resid_pdrop": 0.0,
                         "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": None,
                         "eos_token_id": None, **extra})


IMPORTS = {
    "llama_gqa_untied_wide_heads": lambda: _llama_config(
        head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "llama_tied_scaled_biases": lambda: _llama_config(
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}),
    "gpt2_tied": lambda: _gpt2_config(),
    "mixtral_top2": lambda: _mixtral_config(),
}


@pytest.mark.parametrize("case", list(IMPORTS))
def test_import_gives_the_same_logits(megatron_world, case):
    from transformers import AutoModelForCausalLM

    from megatron_streaming.parallel import distributed
    from megatron_streaming.config.shape import padded_vocab_size
    from megatron_streaming.worker.model import build_model

    torch.manual_seed(0)
    theirs = AutoModelForCausalLM.from_config(IMPORTS[case](), dtype=torch.float32).eval()
    _perturb(theirs.named_parameters(), 6)
    flags, params = hf.from_hf(theirs.config, theirs.state_dict())
    cfg = parse_args(["--mock-data", "--seq-length", str(SEQ), *flags])
    validate(cfg, 1)
    assert hf.architecture(cfg.model) == case.split("_")[0]
    distributed.seed_everything(1, 0)
    ours = build_model(cfg.model, cfg.parallel, megatron_world, VOCAB).eval()
    padded = hf.pad_vocab(params, padded_vocab_size(VOCAB, cfg.model.make_vocab_size_divisible_by,
                                                    1))
    names = [n for n, _ in ours.named_parameters()]
    assert sorted(names) == sorted(padded)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(padded[name])
        diff = (theirs(_tokens()).logits - _our_logits(ours, _tokens())).abs().max().item()
    print(f"{case}: max |logit difference| {diff:.2e}")
    assert diff < ATOL
    # Exporting the import gives back the very same tensors.
    config, state = hf.to_hf(cfg.model, params, VOCAB)
    original = theirs.state_dict()
    assert state.keys() == original.keys()
    for key, tensor in state.items():
        assert torch.equal(tensor, original[key]), key


def test_zero_centred_import_subtracts_one():
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_config(_llama_config(), dtype=torch.float32)
    flags, params = hf.from_hf(theirs.config, theirs.state_dict(), apply_layernorm_1p=True)
    assert "--apply-layernorm-1p" in flags
    assert torch.equal(params["decoder.final_layernorm.weight"], torch.zeros(64))
    config, state = hf.to_hf(parse_args(["--mock-data", *flags]).model, params, VOCAB)
    assert torch.equal(state["model.norm.weight"], torch.ones(64))


def test_import_takes_original_gpt2_files():
    """openai-community/gpt2's file layout: no ``transformer.`` prefix, no tied lm_head, and
    the causal-mask buffers saved as ``h.N.attn.bias``."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_config(_gpt2_config()).state_dict()
    bare = {k.removeprefix("transformer."): t for k, t in state.items() if k != "lm_head.weight"}
    bare["h.0.attn.bias"] = torch.ones(1, 1, SEQ, SEQ)
    config = _gpt2_config()
    want, got = hf.from_hf(config, state)[1], hf.from_hf(config, bare)[1]
    assert want.keys() == got.keys()
    assert all(torch.equal(want[name], got[name]) for name in want)


def test_export_refuses_parameters_it_cannot_place(megatron_world):
    model_cfg, model = _our_model(megatron_world, [])
    params = _params(model)
    params["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(16)
    with pytest.raises(ValueError, match="no conversion for .*q_layernorm"):
        hf.to_hf(model_cfg, params, VOCAB)
    del params["decoder.final_layernorm.bias"]
    with pytest.raises(ValueError, match="no 'decoder.final_layernorm.bias'"):
        hf.to_hf(model_cfg, params, VOCAB)


def test_transformer_engine_norm_names():
    """Export takes Transformer Engine's fused norm names; import can be renamed to them."""
    params = {"decoder.layers.0.input_layernorm.weight": torch.ones(1),
              "decoder.layers.0.pre_mlp_layernorm.weight": torch.ones(1),
              "decoder.final_layernorm.weight": torch.ones(1)}
    te = ["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
          "decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.final_layernorm.weight"]
    renamed = hf.layer_spec_names(params, te)
    assert sorted(renamed) == sorted(te)
    assert hf._local_names(renamed).keys() == params.keys()


@pytest.mark.parametrize("flags, message", [
    (["--position-embedding-type", "none"], "--position-embedding-type none"),
    ([*LLAMA, "--rotary-percent", "0.5"], "--rotary-percent 0.5"),
    (["--normalization", "RMSNorm"], "--normalization RMSNorm"),
    (["--swiglu"], "--swiglu True"),
    (["--position-embedding-type", "rope"], "--swiglu False"),
    (["--kv-channels", "32"], "--kv-channels 32"),
    (["--group-query-attention", "--num-query-groups", "2"], "--num-query-groups 2"),
    (["--ladder-residual"], "--ladder-residual"),
    ([*LLAMA, "--num-experts", "4", "--moe-layer-freq", "2"], "--moe-layer-freq 2"),
    ([*LLAMA, "--num-experts", "4", "--moe-shared-expert-intermediate-size", "64"],
     "Mixtral has no shared experts"),
    ([*LLAMA, "--num-experts", "4", "--moe-router-pre-softmax"], "--moe-router-pre-softmax"),
])
def test_unsupported_configs_name_the_flag(flags, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        hf.architecture(parse_args([*TINY, *flags]).model)


@pytest.mark.parametrize("config, message", [
    (lambda: _gpt2_config(activation_function="gelu_new"), "activation_function 'gelu_new'"),
    (lambda: _llama_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4 + 0.5}),
     "rope_theta 10000.5"),
    (lambda: _llama_config(rope_parameters={"rope_type": "linear", "rope_theta": 1e4,
                                            "factor": 2.0}), "rope_type 'linear'"),
    (lambda: _llama_config(attention_bias=True), "attention_bias True with mlp_bias False"),
])
def test_unsupported_hf_models_name_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        hf.from_hf(config(), {})


def test_load_refuses_other_models_and_pickles(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    with pytest.raises(ValueError, match=r"config\.json: model_type 'mistral'"):
        hf.load_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(_gpt2_config().to_json_string())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"model\.safetensors: no such file.*never pickles"):
        hf.load_hf(str(tmp_path))
