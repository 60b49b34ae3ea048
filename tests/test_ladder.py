"""Ladder residual (arXiv 2501.06589, megatron_streaming/worker/ladder.py).

* the ``--ladder-layers`` parser and the pipeline-boundary check, without processes;
* TP=1 in-process: a ladder GPT equals a hand-written reference of the ladder equations built
  from a standard GPT with the same weights, and differs from the standard GPT;
* one 2-rank gloo launch (TP=2): all-ladder and partly-ladder GPTs give the TP=1 loss and
  every parameter gradient, and a ``LadderTrace`` shows each all-reduce is waited on only
  after the next sub-block's compute started;
* a 2-rank (PP=2) and a 4-rank (TP=2 x PP=2) gloo launch through megatron's 1F1B schedule:
  ladder runs inside a stage and across the stage boundary give the single-process loss and
  every parameter gradient.
"""

import dataclasses
import zlib

import pytest
import torch

from conftest import spawn_gloo

# VOCAB pads to 256 at TP=1 and TP=2 alike (padding rows change the softmax).
HIDDEN, HEADS, SEQ, BATCH, VOCAB, LAYERS = 32, 4, 16, 2, 200, 4
SEED = 5


# ---- parser (no processes) ---------------------------------------------------------------------

def test_parse_ladder_layers_forms():
    from megatron_streaming.worker.ladder import parse_ladder_layers

    assert parse_ladder_layers("all", 4) == {0, 1, 2, 3}
    assert parse_ladder_layers("12-23", 24) == set(range(12, 24))
    assert parse_ladder_layers("last:8", 24) == set(range(16, 24))
    assert parse_ladder_layers("first:2", 24) == {0, 1}
    assert parse_ladder_layers("0, 3-4,last:1", 8) == {0, 3, 4, 7}
    assert parse_ladder_layers("5", 6) == {5}


@pytest.mark.parametrize("spec, fragment", [
    ("", "needs a value"), ("24", "out of range"), ("-1", "out of range"),
    ("5-3", "reversed"), ("last:0", "asks for 0"), ("last:25", "asks for 25"),
    ("middle:2", "'middle'"), ("a-b", "not an integer"), ("1,,2", "empty item"),
    ("last:x", "not an integer"),
])
def test_parse_ladder_layers_errors_name_the_flag_and_value(spec, fragment):
    from megatron_streaming.worker.ladder import parse_ladder_layers

    with pytest.raises(ValueError) as err:
        parse_ladder_layers(spec, 24)
    assert "--ladder-layers" in str(err.value) and fragment in str(err.value)
    if spec:
        assert repr(spec) in str(err.value)


def test_ladder_flags_combine_and_stage_crossings():
    from megatron_streaming.worker.ladder import ladder_layer_set, stage_crossings

    assert ladder_layer_set(True, None, 3) == {0, 1, 2}
    assert ladder_layer_set(False, "last:1", 3) == {2}
    assert ladder_layer_set(False, None, 3) == set()
    with pytest.raises(ValueError, match="--ladder-residual"):
        ladder_layer_set(True, "1", 3)
    assert stage_crossings({2, 3}, 4, 2) == []  # upper half = the second stage exactly
    assert stage_crossings({1, 2}, 4, 2) == [2]
    assert stage_crossings(set(range(8)), 8, 4) == [2, 4, 6]
    assert stage_crossings({0, 1, 2, 3}, 4, 1) == []


# ---- model helpers (used in-process and on the ranks) --------------------------------------------

def _configs(tp=1, pp=1):
    from megatron_streaming.config import ModelConfig, ParallelConfig
    from megatron_streaming.worker.model import transformer_config

    cfg = ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                      seq_length=SEQ, transformer_impl="local", hidden_dropout=0.0,
                      attention_dropout=0.0)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return cfg, parallel, transformer_config(cfg, parallel)


def _build(topo, ladder, trace=None, tied=True):
    """What build_model does, with the ladder block spec in place of the layer spec."""
    from megatron.core.models.gpt import GPTModel

    from megatron_streaming.worker import ladder as ladder_mod
    from megatron_streaming.worker import weights
    from megatron_streaming.parallel.distributed import seed_everything
    from megatron_streaming.config.shape import padded_vocab_size
    from megatron_streaming.worker.model import layer_spec

    tp, pp = topo.layout.tp, topo.layout.pp
    cfg, _, config = _configs(tp, pp)
    spec = layer_spec(cfg)
    if ladder:
        spec = ladder_mod.ladder_block_spec(config, spec, set(ladder), topo.pp_rank, trace)
    seed_everything(SEED, topo.tp_rank)
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=padded_vocab_size(VOCAB, cfg.make_vocab_size_divisible_by, tp),
                     max_sequence_length=SEQ, pre_process=topo.is_first_stage,
                     post_process=topo.is_last_stage, share_embeddings_and_output_weights=tied,
                     position_embedding_type="learned_absolute",
                     pg_collection=topo.pg_collection())
    weights.initialize_weights(model, seed=SEED, std=cfg.init_method_std, num_layers=LAYERS,
                               layer_offset=topo.first_layer(LAYERS),
                               tp_rank=topo.tp_rank, tp_size=tp)
    _random_biases(model, topo.tp_rank, tp, topo.first_layer(LAYERS))
    return model


@torch.no_grad()
def _random_biases(model, tp_rank, tp_size, layer_offset):
    """Non-zero biases (layout-free, like the weights): a bias added before the TP reduction,
    or twice, would then change the result."""
    from megatron_streaming.worker import weights

    for name, p in model.named_parameters():
        if not name.endswith(".bias") or "norm" in name:
            continue
        shape = list(p.shape)
        if getattr(p, "tensor_model_parallel", False):
            shape[p.partition_dim] *= tp_size
        name = weights.global_name(name, layer_offset)
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        full = torch.randn(shape, generator=g) * 0.05
        if getattr(p, "tensor_model_parallel", False):
            full = full.chunk(tp_size, dim=p.partition_dim)[tp_rank]
        p.copy_(full)


def _batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(SEQ).repeat(BATCH, 1), "attention_mask": mask}


def _loss_and_grads(model, tp_group=None):
    """Mean token loss and every parameter's full (TP-gathered) gradient, by name."""
    b = _batch()
    model.zero_grad(set_to_none=True)
    losses = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    loss = losses.float().mean()
    loss.backward()
    return loss.item(), {name: _full_grad(p, tp_group) for name, p in model.named_parameters()}


def _full_grad(p, tp_group):
    import torch.distributed as dist

    g = p.grad.detach().clone()
    if tp_group is not None and getattr(p, "tensor_model_parallel", False):
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, g, group=tp_group)
        g = torch.cat(parts, dim=p.partition_dim)
    return g


def _reference_logits(std, ladder):
    """The ladder equations written out over a *standard* GPT's submodules (whose output
    projections all-reduce synchronously; at TP=1 that is the sum of one part)."""
    b = _batch()
    mask = b["attention_mask"]
    r = std.embedding(input_ids=b["tokens"], position_ids=b["position_ids"])
    pending = {}

    def add(r, sub):
        if sub not in pending:
            return r
        out, bias = pending.pop(sub)
        return r + (out + bias)

    for i, layer in enumerate(std.decoder.layers):
        if i not in ladder:
            r = add(add(r, "attn"), "mlp")
            r, _ = layer(hidden_states=r, attention_mask=mask)
            continue
        r = add(r, "attn")
        pending["attn"] = layer.self_attention(layer.input_layernorm(r), attention_mask=mask)
        r = add(r, "mlp")
        pending["mlp"] = layer.mlp(layer.pre_mlp_layernorm(r))
    r = add(add(r, "attn"), "mlp")
    logits, _ = std.output_layer(std.decoder.final_layernorm(r),
                                 weight=std.shared_embedding_or_output_weight())
    return logits.transpose(0, 1)


def _logits(model):
    b = _batch()
    return model(b["tokens"], b["position_ids"], b["attention_mask"])


# ---- TP=1 in-process ---------------------------------------------------------------------------

LADDER_CASES = {"all": set(range(LAYERS)), "upper_half": {2, 3}, "middle": {1, 2}}


@pytest.mark.parametrize("case", sorted(LADDER_CASES))
def test_tp1_ladder_matches_hand_written_equations(case, megatron_world):
    from megatron_streaming.worker.ladder import LadderTransformerLayer

    ladder = LADDER_CASES[case]
    std, lad = _build(megatron_world, set()), _build(megatron_world, ladder)
    kinds = [isinstance(layer, LadderTransformerLayer) for layer in lad.decoder.layers]
    assert kinds == [i in ladder for i in range(LAYERS)]
    # Same parameters under the same names: checkpoints and the weight init do not change.
    assert [n for n, _ in std.named_parameters()] == [n for n, _ in lad.named_parameters()]
    with torch.no_grad():
        got, ref, plain = _logits(lad), _reference_logits(std, ladder), _logits(std)
    assert torch.allclose(got, ref, atol=1e-6, rtol=0), (got - ref).abs().max()
    # The standard path is really a different computation.
    assert (got - plain).abs().max() > 1e-3
    # Control: the reference with no ladder layer is the standard model.
    with torch.no_grad():
        assert torch.allclose(_reference_logits(std, set()), plain, atol=1e-6, rtol=0)


def test_ladder_needs_the_local_spec(megatron_world):
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_streaming.worker.ladder import ladder_block_spec

    _, _, config = _configs()
    spec = gpt_layer_specs.get_gpt_layer_local_spec()
    bogus = spec.submodules.mlp.submodules.__class__(
        linear_fc1=spec.submodules.mlp.submodules.linear_fc1, linear_fc2=torch.nn.Linear)
    spec = dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, mlp=dataclasses.replace(spec.submodules.mlp, submodules=bogus)))
    with pytest.raises(ValueError, match="local spec"):
        ladder_block_spec(config, spec, {0}, 0)


def test_pipeline_stage_specs(megatron_world):
    """Per stage, the spec holds that stage's layers; a run inside a stage ends there; a run
    crossing a stage boundary hands over to the next stage with variable-shape p2p."""
    from megatron_streaming.worker.ladder import LadderTransformerLayer, ladder_block_spec
    from megatron_streaming.worker.model import layer_spec

    cfg, _, config = _configs(pp=2)
    base = layer_spec(cfg)
    first = ladder_block_spec(config, base, {2, 3}, pp_rank=0)
    second = ladder_block_spec(config, base, {2, 3}, pp_rank=1)
    assert all(s is base for s in first.layer_specs)

    def roles(spec):
        keys = ("starts_run", "ends_run", "receives", "sends")
        return [(s.module is LadderTransformerLayer, *(s.params.get(k) for k in keys))
                for s in spec.layer_specs]

    assert roles(second) == [(True, True, False, False, False), (True, False, True, False, False)]
    assert not config.variable_seq_lengths
    first = ladder_block_spec(config, base, {1, 2}, pp_rank=0)
    assert roles(first) == [(False, None, None, None, None), (True, True, False, False, True)]
    assert config.variable_seq_lengths  # stage 0 hands over [2s, b, h]
    second = ladder_block_spec(config, base, {1, 2}, pp_rank=1)
    assert roles(second) == [(True, False, True, True, False), (False, None, None, None, None)]


# ---- TP=2 against TP=1 (one 2-rank launch) -----------------------------------------------------

TP_CASES = {"all": set(range(LAYERS)), "upper_half": {2, 3}, "middle": {1, 2}, "none": set()}


def _tp2_worker(rank, world, group):
    import patches
    from megatron_streaming.parallel.distributed import seed_everything
    from megatron_streaming.worker.ladder import LadderTrace
    from megatron_streaming.parallel.topology import RankLayout, Topology

    patches.apply()
    topo = Topology.create(RankLayout(world_size=world, tp=world), rank)
    topo.install_into_megatron()
    seed_everything(SEED, topo.tp_rank)
    tp_group = topo.pg_collection().tp
    out = {name: _loss_and_grads(_build(topo, ladder), tp_group)
           for name, ladder in TP_CASES.items()}

    trace = LadderTrace()
    model = _build(topo, {0, 1, 2}, trace)
    with torch.no_grad():
        _logits(model)
    out["trace"] = (trace.events, trace.completed_at_wait)
    return out


@pytest.mark.timeout(180)
def test_tp2_ladder_equals_tp1(tmp_path_factory, megatron_world):
    results = spawn_gloo(_tp2_worker, 2, tmp_path_factory.mktemp("ladder_tp2"))
    for case, ladder in TP_CASES.items():
        ref_loss, ref_grads = _loss_and_grads(_build(megatron_world, ladder))
        for rank, res in enumerate(results):
            loss, grads = res[case]
            assert loss == pytest.approx(ref_loss, rel=1e-5, abs=0), (case, rank)
            assert grads.keys() == ref_grads.keys()
            for name, g in grads.items():
                assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6), \
                    (case, rank, name, (g - ref_grads[name]).abs().max())
    # Ladder changes the loss (the TP comparison above is not vacuous).
    assert results[0]["all"][0] != pytest.approx(results[0]["none"][0], rel=1e-6)

    # Asynchrony, by instrumentation: every TP all-reduce is issued before the next
    # sub-block's compute starts and waited on only after it started.
    events, completed = results[0]["trace"]
    pos = {e: i for i, e in enumerate(events)}
    subs = [(layer, sub) for layer in (0, 1, 2) for sub in ("attn", "mlp")]
    for k, (layer, sub) in enumerate(subs):
        issue, wait = pos[("issue", layer, sub)], pos[("wait", layer, sub)]
        assert pos[("compute", layer, sub)] < issue < wait
        if k + 1 < len(subs):
            assert issue < pos[("compute", *subs[k + 1])] < wait, (layer, sub, events)
    # Layer 3 is an ordinary layer: it starts after the ladder run is flushed.
    assert all(e[1] != 3 for e in events)
    # At TP=2 every wait found a real asynchronous handle (None would mean no all-reduce).
    assert set(completed) == set(subs) and all(v is not None for v in completed.values())


# ---- PP=2 against PP=1 (one 2-rank launch, megatron's 1F1B schedule) --------------------------

PP_CASES = {"crossing": {1, 2}, "all": set(range(LAYERS)), "upper_half": {2, 3}, "none": set()}
MICRO_BATCHES = 2


def _pipeline_loss_and_grads(topo, model):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from megatron_streaming.worker.weights import global_name

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}

    def step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
        return out, loss_func

    model.zero_grad(set_to_none=True)
    outputs = get_forward_backward_func(pp_size=topo.layout.pp, vp_size=None)(
        forward_step_func=step, data_iterator=iter([_batch()] * MICRO_BATCHES), model=model,
        num_microbatches=MICRO_BATCHES, seq_length=SEQ, micro_batch_size=BATCH,
        forward_only=False, p2p_communicator=P2PCommunicator(pp_group=topo.groups["pp"],
                                                             config=model.config),
        pg_collection=topo.pg_collection())
    offset = topo.first_layer(LAYERS)
    grads = {global_name(n, offset): _full_grad(p, topo.pg_collection().tp)
             for n, p in model.named_parameters()}
    losses = [o["loss"].item() for o in outputs] if topo.is_last_stage else None
    return losses, grads


def _pp2_worker(rank, world, group, tp):
    import patches
    from megatron_streaming.parallel.distributed import seed_everything
    from megatron_streaming.parallel.topology import RankLayout, Topology

    patches.apply()
    topo = Topology.create(RankLayout(world_size=world, tp=tp, pp=world // tp), rank)
    topo.install_into_megatron()
    seed_everything(SEED, topo.tp_rank)
    return {name: _pipeline_loss_and_grads(topo, _build(topo, ladder, tied=False))
            for name, ladder in PP_CASES.items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "tp2_pp2"])
def test_pp2_ladder_equals_pp1(tp, tmp_path_factory, megatron_world):
    results = spawn_gloo(_pp2_worker, 2 * tp, tmp_path_factory.mktemp(f"ladder_pp2_tp{tp}"),
                         tp)
    last = results[tp:]  # the second stage's ranks
    for case, ladder in PP_CASES.items():
        ref_loss, ref_grads = _loss_and_grads(_build(megatron_world, ladder, tied=False))
        for res in last:
            assert res[case][0] == pytest.approx([ref_loss] * MICRO_BATCHES, rel=1e-5,
                                                 abs=0), case
        grads = {**results[0][case][1], **last[0][case][1]}
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            assert torch.allclose(g, ref_grads[name], rtol=1e-4, atol=1e-6), \
                (case, name, (g - ref_grads[name]).abs().max())
    # The ladder cases compute something else than the standard model (not vacuous); a
    # crossing run flushed at the stage end instead of handed over would fail above.
    for case in ("crossing", "all", "upper_half"):
        assert last[0][case][0][0] != pytest.approx(last[0]["none"][0][0], rel=1e-5)
