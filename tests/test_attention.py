"""The fused core attention (torch's scaled_dot_product_attention) against megatron-core's
unfused DotProductAttention, in-process: outputs and q/k/v gradients in fp32 (causal, an
explicit mask, grouped-query attention, TP-like head counts, a given softmax scale, a head
size apart from hidden / heads), dropout's rate and its determinism under one seed, the
choice by --attention-backend, and one training step's loss and gradients of the whole GPT,
with selective recompute too. Ulysses around it: tests/test_ulysses.py."""

from types import SimpleNamespace

import pytest
import torch

from megatron_streaming.worker import model
from megatron_streaming.config import ModelConfig, ParallelConfig

TOL = dict(rtol=1e-5, atol=1e-6)


class _Group(SimpleNamespace):
    def size(self):
        return self.n


def _pair(tp=1, heads=4, groups=None, kv_channels=None, softmax_scale=None, mask_type=None,
          dropout=0.0):
    """(unfused, fused) built from one config: ``heads`` query heads and ``groups`` key/value
    groups over ``tp`` tensor-parallel ranks (a stand-in group: only its size is read)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_streaming.worker.attention import SDPAttention
    from megatron_streaming.parallel.distributed import seed_everything

    seed_everything(0, 0)  # megatron-core's attention forks the tracker's stream even at p = 0
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=heads,
                      group_query_attention=groups is not None, num_query_groups=groups,
                      kv_channels=kv_channels, attention_dropout=dropout,
                      transformer_impl="local")
    config = model.transformer_config(cfg, ParallelConfig(tensor_model_parallel_size=tp))
    kw = dict(layer_number=1, attn_mask_type=mask_type or AttnMaskType.causal,
              attention_type="self", softmax_scale=softmax_scale,
              pg_collection=SimpleNamespace(tp=_Group(n=tp)))
    return DotProductAttention(config, **kw), SDPAttention(config, **kw)


def _inputs(s, heads, groups, d, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, heads, d, generator=g)
    k, v = (torch.randn(s, b, groups, d, generator=g) for _ in range(2))
    return q, k, v, torch.randn(s, b, heads * d, generator=g)


def _run(attention, q, k, v, w, mask):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, mask)
    (out * w).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _padding_mask(s, b=2):
    """Megatron's convention (True = masked out): each sample's last keys are padding, a
    different count per sample; no query is left without a key."""
    mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for i in range(b):
        mask[i, :, :, s - 2 - 3 * i:] = True
    return mask


CASES = {  # name: (pair kwargs, heads and groups on this rank, head size, mask)
    "causal": (dict(), 4, 4, 8, None),
    "explicit_causal_mask": (dict(), 4, 4, 8, "causal"),
    "padding_mask": (dict(mask_type="padding"), 4, 4, 8, "padding"),
    "gqa_4_heads_2_groups": (dict(groups=2), 4, 2, 8, None),
    "gqa_with_mask": (dict(groups=2), 4, 2, 8, "causal"),
    "tp2_of_8_heads_4_groups": (dict(tp=2, heads=8, groups=4), 4, 2, 4, None),
    "softmax_scale": (dict(softmax_scale=0.3), 4, 4, 8, None),
    "kv_channels_16": (dict(kv_channels=16), 4, 4, 16, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_equals_unfused_forward_and_backward(megatron_world, case):
    kwargs, heads, groups, d, mask_kind = CASES[case]
    unfused, fused = _pair(**kwargs)
    s = 24
    q, k, v, w = _inputs(s, heads, groups, d)
    mask = {None: None, "padding": _padding_mask(s),
            "causal": torch.ones(s, s, dtype=torch.bool).triu(1).view(1, 1, s, s)}[mask_kind]
    out_ref, grads_ref = _run(unfused, q, k, v, w, mask)
    out, grads = _run(fused, q, k, v, w, mask)
    assert out.shape == (s, 2, heads * d)
    torch.testing.assert_close(out, out_ref, **TOL)
    for name, got, want in zip("qkv", grads, grads_ref):
        torch.testing.assert_close(got, want, **TOL, msg=f"d{name}")
    assert fused.softmax_scale == pytest.approx(unfused.softmax_scale)
    # A control: the comparison sees a wrong mask.
    if mask_kind == "padding":
        wrong, _ = _run(fused, q, k, v, w, None)
        assert (wrong - out_ref).abs().max() > 1e-2


def test_grouped_heads_are_repeated_where_the_kernel_cannot_group(megatron_world, monkeypatch):
    """CUDA's memory-efficient kernel (fp32 or a mask) takes no key/value groups: the heads are
    repeated instead, megatron-core's grouping; its flash kernel and the CPU's group them."""
    from megatron_streaming.worker import attention

    cuda = SimpleNamespace(type="cuda")
    assert attention._kernel_takes_groups(SimpleNamespace(device=cuda, dtype=torch.bfloat16),
                                          None)
    for dtype, mask in ((torch.float32, None), (torch.bfloat16, torch.ones(1, dtype=bool))):
        assert not attention._kernel_takes_groups(SimpleNamespace(device=cuda, dtype=dtype),
                                                  mask)
    assert attention._kernel_takes_groups(torch.ones(1), torch.ones(1, dtype=bool))
    monkeypatch.setattr(attention, "_kernel_takes_groups", lambda q, mask: False)
    unfused, fused = _pair(heads=8, groups=2)
    q, k, v, w = _inputs(24, 8, 2, 4)
    out_ref, grads_ref = _run(unfused, q, k, v, w, None)
    out, grads = _run(fused, q, k, v, w, None)
    torch.testing.assert_close(out, out_ref, **TOL)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, **TOL)


def test_dropout_keeps_each_probability_at_the_rate_and_one_seed_redraws_it(megatron_world):
    """With the values one-hot per key the context *is* the dropped-out probability matrix:
    a fraction p of the kept probabilities is zero, the rest are the unfused probabilities
    over 1 - p; the same seed draws the same mask, another seed another; eval draws none."""
    from megatron_streaming.parallel.distributed import seed_everything

    p, s, heads, b = 0.25, 32, 4, 2
    unfused, fused = _pair(dropout=p, kv_channels=s)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(s, b, heads, s, generator=g)
    k = torch.randn(s, b, heads, s, generator=g)
    v = torch.eye(s).view(s, 1, 1, s).expand(s, b, heads, s).contiguous()
    unfused.eval()
    probs = unfused(q, k, v, None).view(s, b, heads, s)

    def draw(seed):
        seed_everything(seed, 0)
        return fused(q, k, v, None).view(s, b, heads, s)

    first = draw(3)
    kept = torch.ones(s, s, dtype=torch.bool).tril().view(s, 1, 1, s).expand_as(first)
    zero = (first == 0) & kept
    assert abs(zero.sum().item() / kept.sum().item() - p) < 0.02
    survivors = ~zero & kept
    torch.testing.assert_close(first[survivors], probs[survivors] / (1 - p), **TOL)
    assert torch.equal(draw(3), first)
    assert not torch.equal(draw(4), first)
    fused.eval()
    torch.testing.assert_close(fused(q, k, v, None), probs.reshape(s, b, -1), **TOL)


def test_unsupported_inputs_are_refused_by_name(megatron_world):
    from megatron.core.packed_seq_params import PackedSeqParams

    _, fused = _pair()
    q, k, v, _ = _inputs(8, 4, 4, 8)
    with pytest.raises(ValueError, match="packed sequences"):
        fused(q, k, v, None, packed_seq_params=PackedSeqParams())
    with pytest.raises(ValueError, match="must be boolean"):
        fused(q, k, v, torch.zeros(1, 1, 8, 8))


@pytest.mark.parametrize("backend, kind", [
    ("flash", "SDPAttention"), ("fused", "SDPAttention"), ("unfused", "DotProductAttention"),
    ("local", "DotProductAttention"), ("auto", "SDPAttention")])
def test_attention_backend_names_choose_the_core_attention(backend, kind):
    """Megatron's names on the local layers; ``auto`` is the faster (docs/RESULTS.md)."""
    cfg = ModelConfig(transformer_impl="local", attention_backend=backend)
    spec = model.layer_spec(cfg)
    assert spec.submodules.self_attention.submodules.core_attention.__name__ == kind
    assert model.loader_makes_mask(cfg) == (kind == "DotProductAttention")
    assert ("scaled_dot_product_attention" in model.describe_attention(cfg)) == \
        (kind == "SDPAttention")


def test_ulysses_spec_wraps_the_chosen_core_attention():
    from megatron_streaming.worker.attention import SDPAttention

    group = _Group(n=2)
    for backend, inner in (("flash", SDPAttention), ("unfused", None)):
        spec = model.layer_spec(ModelConfig(attention_backend=backend), group)
        builder = spec.submodules.self_attention.submodules.core_attention
        assert builder.keywords["sp_group"] is group
        got = builder.keywords["inner_class"]
        assert (got is inner) if inner else got.__name__ == "DotProductAttention"


def _gpt_step(topo, flags):
    """Loss and gradients of one forward/backward of a toy GPT (GQA, causal by the mask
    type: no mask given, as the loader gives none to the fused attention)."""
    from megatron_streaming.parallel import distributed
    from megatron_streaming.worker import weights
    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.worker.model import build_model

    cfg = parse_args(["--mock-data", "--num-layers", "2", "--hidden-size", "32",
                      "--num-attention-heads", "4", "--num-key-value-heads", "2",
                      "--seq-length", "32", "--hidden-dropout", "0", "--attention-dropout", "0",
                      *flags])
    m = cfg.model
    gpt = build_model(m, cfg.parallel, topo, 100)
    weights.initialize_weights(gpt, seed=3, std=m.init_method_std, num_layers=m.num_layers,
                               layer_offset=0, tp_rank=0, tp_size=1)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 100, (2, m.seq_length + 1), generator=g)
    distributed.seed_everything(11, 0)
    loss = gpt(tokens[:, :-1], torch.arange(m.seq_length).repeat(2, 1), None,
               labels=tokens[:, 1:]).float().mean()
    loss.backward()
    attention = gpt.decoder.layers[0].self_attention.core_attention
    return loss.item(), {n: p.grad for n, p in gpt.named_parameters()}, type(attention).__name__


def test_gpt_step_with_fused_attention_equals_unfused(megatron_world):
    """The whole model's loss and every gradient, --attention-backend flash (and the flag
    Megatron-DeepSpeed scripts pass) against unfused; selective recompute of the core
    attention gives the same numbers."""
    loss, grads, kind = _gpt_step(megatron_world, ["--attention-backend", "unfused"])
    assert kind == "DotProductAttention"
    for flags in (["--attention-backend", "flash"], ["--use-flash-attn-v2"],
                  ["--attention-backend", "flash", "--recompute-granularity", "selective"]):
        got_loss, got, got_kind = _gpt_step(megatron_world, flags)
        assert got_kind == "SDPAttention", flags
        assert got_loss == pytest.approx(loss, rel=1e-6), flags
        for name, grad in grads.items():
            error = (got[name] - grad).abs().max() / grad.abs().max()
            assert error < 1e-5, (flags, name, error.item())


# ---- which SDPA kernel the configuration gets on a GPU ---------------------------------------

@pytest.mark.parametrize("groups,precision,dropout,refusals,note", [
    # flash takes it: nothing to say
    (None, "bf16", 0.0, {"flash": None, "memory-efficient": None}, None),
    # fp32 with dropout: the memory-efficient kernel takes it
    (2, "fp32", 0.1, {"flash": "needs fp16 or bf16", "memory-efficient": None}, None),
    # neither: the math kernel, said in one line with both reasons
    (2, "bf16", 0.1, {"flash": "head size above 256", "memory-efficient": "no sm50"},
     "--attention-backend: torch's scaled_dot_product_attention runs its math kernel on this "
     "GPU for bfloat16, head size 8, 4 heads of 2 groups, dropout 0.1: O(s^2) memory for the "
     "scores, as the unfused attention (flash: head size above 256; memory-efficient: no "
     "sm50)"),
])
def test_the_math_kernel_on_a_gpu_is_said_at_start(megatron_world, monkeypatch, groups,
                                                   precision, dropout, refusals, note):
    """SDPA falls back to its math kernel (O(s^2) scores) where neither fused kernel takes
    the inputs, without a word: torch's own checks (faked here: this machine has no GPU) are
    asked once, with the model's dtype, head size, heads, groups and dropout, and a math
    kernel is said."""
    from megatron_streaming.config import PrecisionConfig
    from megatron_streaming.worker import attention

    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                      group_query_attention=groups is not None, num_query_groups=groups,
                      attention_dropout=dropout, transformer_impl="local")
    config = model.transformer_config(cfg, ParallelConfig(),
                                      precision=PrecisionConfig(bf16=precision == "bf16"))
    layer = attention.SDPAttention(config, layer_number=1, attn_mask_type=None,
                                   attention_type="self")
    container = torch.nn.Sequential(torch.nn.Linear(2, 2), layer)
    assert attention.kernel_note(container) is None  # no GPU: the CPU's kernel, nothing said
    # torch's checks take the probe's tensors (a CPU build refuses both, saying nothing)
    assert set(attention._probe(torch.device("cpu"), torch.bfloat16, 4, 2, 8, 0.1, True)) == \
        set(attention.FUSED_KERNELS)
    asked = []

    def probe(device, dtype, heads, kv_groups, head_dim, p, native_groups):
        asked.append((device, dtype, heads, kv_groups, head_dim, p, native_groups))
        return refusals

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(attention, "_probe", probe)
    assert attention.kernel_note(container) == note
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    assert asked == [(torch.device("cuda", 3), dtype, 4, groups or 4, 8, dropout,
                      groups is not None and precision == "bf16")]
