"""The fragment schedule and the fragment assignment (Streaming DiLoCo, arXiv 2501.18512).

Expected numbers are derived here from the algorithm, not read back from the library.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_streaming.config import Config
from megatron_streaming.streaming import builder, settings
from megatron_streaming.streaming.fragments import FragmentPlan
from megatron_streaming.streaming.schedule import SyncSchedule, spaced_sends, sync_weights


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- schedule.py ------------------------------------------------------------------------------

VALID_SCHEDULES = [(6, 3, 0), (6, 3, 1), (12, 4, 2), (4, 1, 0), (100, 1, 0), (30, 3, 5),
                   (30, 3, 9), (8, 8, 0), (5, 1, 4)]


@pytest.mark.parametrize("H,P,tau", VALID_SCHEDULES)
def test_schedule_sends_one_fragment_every_H_over_P_steps(H, P, tau):
    sched = SyncSchedule(H, P, tau)
    steps = range(1, 5 * H + 1)
    for s in steps:
        sends = sched.sends_after(s)
        assert len(sends) == (1 if s % (H // P) == 0 else 0), (s, sends)
        assert all(0 <= p < P for p in sends)
    # Fragment p's k-th send is after step k*H - p*H/P: every H steps, first within (0, H].
    for p in range(P):
        sent = [s for s in steps if p in sched.sends_after(s)]
        expected = [k * H - p * (H // P) for k in range(1, 6)]
        assert sent == [s for s in expected if s >= 1], (p, sent)
        assert all(b - a == H for a, b in zip(sent, sent[1:]))
        assert [sched.send_step_of(p, k) for k in range(1, 6)] == expected
    assert sched.sends_after(0) == sched.sends_after(-H) == []


@pytest.mark.parametrize("H,P,tau", VALID_SCHEDULES)
def test_schedule_merges_tau_steps_after_sends_and_tracks_in_flight(H, P, tau):
    sched = SyncSchedule(H, P, tau)
    in_flight = {}  # fragment -> step it was sent after
    for s in range(1, 5 * H + 1):
        assert sched.merges_after(s) == sched.sends_after(s - tau)
        for p in sched.sends_after(s):
            assert p not in in_flight, "a fragment is sent again before its merge"
            in_flight[p] = s
        for p in sched.merges_after(s):
            assert in_flight.pop(p) == s - tau
        # Exactly the fragments sent in (s - tau, s].
        assert sorted(sched.in_flight_after(s)) == sorted(in_flight), s
        assert all(s - tau < sent <= s for sent in in_flight.values())
        if tau == 0:
            assert sched.in_flight_after(s) == []


@pytest.mark.parametrize("H", [1, 4, 100])
def test_schedule_one_fragment_no_overlap_is_plain_diloco(H):
    sched = SyncSchedule(H, 1, 0)
    for s in range(1, 5 * H + 1):
        expected = [0] if s % H == 0 else []
        assert sched.sends_after(s) == expected
        assert sched.merges_after(s) == expected
        assert sched.in_flight_after(s) == []


@pytest.mark.parametrize("H,P,tau,flags", [
    (6, 4, 0, ["--diloco-inner-steps (6)", "--diloco-fragments (4)"]),
    (10, 3, 0, ["--diloco-inner-steps (10)", "--diloco-fragments (3)"]),
    (6, 3, 2, ["--diloco-overlap-steps (2)", "6/3 = 2"]),
    (6, 3, 5, ["--diloco-overlap-steps (5)"]),
    (4, 1, 4, ["--diloco-overlap-steps (4)", "4/1 = 4"]),
    (6, 3, -1, ["--diloco-overlap-steps (-1)"]),
    (0, 1, 0, ["--diloco-inner-steps (0)", ">= 1"]),
    (-3, 1, 0, ["--diloco-inner-steps (-3)"]),
    (6, 0, 0, ["--diloco-fragments (0)", ">= 1"]),
    (6, -2, 0, ["--diloco-fragments (-2)"]),
])
def test_schedule_rejects_bad_settings_naming_flags_and_values(H, P, tau, flags):
    with pytest.raises(ValueError) as err:
        SyncSchedule(H, P, tau)
    for text in flags:
        assert text in str(err.value), str(err.value)


@pytest.mark.parametrize("spaced", [False, True])
@pytest.mark.parametrize("H,P", [(6, 3), (4, 1), (12, 4)])
def test_eager_schedule_merges_each_exchange_at_its_fragments_next_send(H, P, spaced):
    send_steps = spaced_sends([1.0 / (i + 1) for i in range(5 * H)], H // P, 0) \
        if spaced else None
    sched = SyncSchedule(H, P, 0, send_steps, eager=True)
    in_flight = {}  # fragment -> step it was sent after
    for s in range(1, 5 * H + 1):
        sends = sched.sends_after(s)
        assert sends == SyncSchedule(H, P, 0, send_steps).sends_after(s)  # same sends
        # A send merges the fragment's previous exchange (none at its first send).
        assert sched.merges_after(s) == [p for p in sends if p in in_flight]
        for p in sends:
            in_flight[p] = s
        assert sorted(sched.in_flight_after(s)) == sorted(in_flight), s
    assert len(in_flight) == P
    with pytest.raises(ValueError, match=r"--diloco-eager .*--diloco-overlap-steps \(1\)"):
        SyncSchedule(H * 2, P, 1, eager=True)


def test_lr_spacing_with_a_constant_lr_is_even_spacing():
    even = SyncSchedule(12, 3, 1)
    spaced = SyncSchedule(12, 3, 1, spaced_sends([1e-3] * 120, even.interval, 1))
    assert spaced.send_steps == tuple(range(4, 121, 4))
    for step in range(0, 200):  # also past the end: sends go on every H/P steps
        assert spaced.sends_after(step) == even.sends_after(step), step
        assert spaced.merges_after(step) == even.merges_after(step), step


@pytest.mark.parametrize("spacing", ["lr", "decay"])
def test_spacing_follows_the_runs_own_learning_rate(spacing):
    from megatron_streaming.cli.arguments import parse_args
    from seams import lr_at

    cfg = parse_args(["--mock-data", "--diloco-workers", "2", "--diloco-inner-steps", "12",
                      "--diloco-fragments", "3", "--diloco-overlap-steps", "1",
                      "--diloco-sync-spacing", spacing, "--lr-decay-style", "cosine",
                      "--lr-warmup-iters", "10", "--train-iters", "240"])
    lrs = [lr_at(i, cfg) for i in range(240)]
    expected = spaced_sends(sync_weights(spacing, lrs), 4, 1)
    assert settings.sync_schedule(cfg).send_steps == expected and len(expected) == 60


@pytest.mark.parametrize("spacing", ["lr", "decay"])
def test_spacing_is_as_often_over_the_run_and_dense_where_it_says(spacing):
    T, H, P, tau = 1200, 30, 3, 1
    lrs = [2e-3 * min(1, (i + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / T)))
           for i in range(T)]
    sends = spaced_sends(sync_weights(spacing, lrs), H // P, tau)
    assert len(sends) == T // (H // P) and sends[-1] == T
    gaps = [b - a for a, b in zip((0, *sends), sends)]
    assert min(gaps) >= tau + 1
    peak = [g for s, g in zip(sends, gaps) if 60 <= s <= 200]  # past the warm-up, lr near peak
    if spacing == "lr":  # dense at the peak lr, sparse at the end
        assert max(peak) < H // P < min(gaps[-5:])
    else:  # sparse at the peak, dense in the warm-up and at the end; 1/sqrt(lr): 10x -> ~3x
        assert max(gaps[-5:]) < H // P < min(peak) and gaps[0] < min(peak)
        assert 2.5 < sum(peak) / len(peak) / (sum(gaps[-5:]) / 5) < 3.5
    schedule = SyncSchedule(H, P, tau, sends)
    fragments = [schedule.sends_after(s) for s in range(1, T + 1)]
    assert sum(len(f) for f in fragments) == len(sends)
    assert [f[0] for f in fragments if f] == [(-k) % P for k in range(1, len(sends) + 1)]
    for s in sends:
        assert schedule.merges_after(s + tau) == schedule.sends_after(s)
        assert schedule.in_flight_after(s) == schedule.sends_after(s)


def test_decay_spacing_with_a_zero_lr_is_even_spacing():
    assert spaced_sends(sync_weights("decay", [0.0] * 120), 4, 1) == tuple(range(4, 121, 4))


def test_spacing_names_the_flag_when_unknown():
    with pytest.raises(ValueError, match=r"--diloco-sync-spacing 'often'"):
        sync_weights("often", [1e-3])


# ---- fragments.py -----------------------------------------------------------------------------

@pytest.mark.parametrize("L", [1, 2, 3, 4, 6, 7])
@pytest.mark.parametrize("pattern", ["strided", "sequential"])
def test_fragments_partition_the_layers(L, pattern):
    for P in range(1, L + 1):
        plan = FragmentPlan(L, P, pattern)
        layer_sets = [plan.layers_of(p) for p in range(P)]
        assert sorted(i for layers in layer_sets for i in layers) == list(range(L))
        assert all(layers for layers in layer_sets), (P, layer_sets)
        for p, layers in enumerate(layer_sets):
            assert all(plan.fragment_of_layer(i) == p for i in layers)
            if pattern == "strided":
                assert layers == list(range(p, L, P))
            else:
                assert layers == list(range(layers[0], layers[-1] + 1))  # contiguous
        if pattern == "sequential":
            # Blocks in order, as even as the division allows.
            assert [layers[0] for layers in layer_sets] == sorted(ls[0] for ls in layer_sets)
            sizes = [len(layers) for layers in layer_sets]
            assert max(sizes) - min(sizes) <= 1 and sum(sizes) == L, sizes


def test_fragments_examples():
    assert FragmentPlan(7, 3, "strided").layers_of(1) == [1, 4]
    assert [FragmentPlan(7, 3, "sequential").layers_of(p) for p in range(3)] == \
        [[0, 1, 2], [3, 4], [5, 6]]
    assert [FragmentPlan(6, 2, "sequential").layers_of(p) for p in range(2)] == \
        [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("pattern", ["strided", "sequential"])
def test_fragment_of_global_names(pattern):
    plan = FragmentPlan(12, 4, pattern)
    first, last = plan.fragment_of_layer(0), plan.fragment_of_layer(11)
    assert (first, last) == (0, 3)
    for layer in range(12):
        for leaf in ("self_attention.linear_qkv.weight", "mlp.linear_fc2.bias",
                     "input_layernorm.weight"):
            name = f"decoder.layers.{layer}.{leaf}"
            expected = layer % 4 if pattern == "strided" else layer // 3
            assert plan.fragment_of(name) == expected, name
    assert plan.fragment_of("embedding.word_embeddings.weight") == first
    assert plan.fragment_of("embedding.position_embeddings.weight") == first
    assert plan.fragment_of("decoder.final_layernorm.weight") == last
    assert plan.fragment_of("decoder.final_layernorm.bias") == last
    assert plan.fragment_of("output_layer.weight") == last
    for unknown in ("decoder.something.weight", "foo", "lm_head.weight", "decoder.layers.x.w"):
        with pytest.raises(ValueError, match="has no fragment"):
            plan.fragment_of(unknown)


def test_fragment_plan_rejects_bad_settings():
    with pytest.raises(ValueError, match=r"--diloco-fragments \(5\).*--num-layers \(4\)"):
        FragmentPlan(4, 5)
    with pytest.raises(ValueError, match=r"--diloco-fragments \(0\)"):
        FragmentPlan(4, 0)
    with pytest.raises(ValueError, match="--diloco-fragment-pattern 'random'"):
        FragmentPlan(4, 2, "random")


@pytest.fixture(scope="module")
def gpt_parameter_names(megatron_world):
    """Parameter names of a real 4-layer megatron-core GPTModel, tied and untied output."""
    from megatron_streaming.parallel import distributed
    from megatron_streaming.config import ModelConfig, ParallelConfig
    from megatron_streaming.worker.model import build_model

    names = {}
    for untie in (False, True):
        distributed.seed_everything(1, 0)
        cfg = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                          transformer_impl="local", untie_embeddings_and_output_weights=untie)
        model = build_model(cfg, ParallelConfig(), megatron_world, 100)
        names[untie] = [n for n, _ in model.named_parameters()]
    return names


@pytest.mark.parametrize("untie", [False, True])
@pytest.mark.parametrize("pattern", ["strided", "sequential"])
def test_every_real_gpt_parameter_is_in_exactly_one_fragment(gpt_parameter_names, megatron_world,
                                                             untie, pattern):
    names = gpt_parameter_names[untie]
    assert ("output_layer.weight" in names) == untie
    assert sum(".layers.0." in n for n in names) >= 6  # attention, MLP, norms
    for P in (1, 2, 4):
        plan = FragmentPlan(4, P, pattern)
        members = {p: set() for p in range(P)}
        for n in names:
            members[plan.fragment_of(n)].add(n)
        assert sum(len(m) for m in members.values()) == len(names)
        assert set().union(*members.values()) == set(names)
        assert all(members.values()), members
        for n in names:
            p = plan.fragment_of(n)
            if n.startswith("decoder.layers."):
                assert p == plan.fragment_of_layer(int(n.split(".")[2])), n
            elif n.startswith("embedding."):
                assert p == plan.fragment_of_layer(0), n
            else:
                assert n.startswith(("decoder.final_layernorm.", "output_layer.")), n
                assert p == plan.fragment_of_layer(3), n
        # On a single stage the builder's local-name function is the same map.
        cfg = Config()
        cfg.model.num_layers, cfg.model.untie_embeddings_and_output_weights = 4, untie
        cfg.streaming.diloco_fragments, cfg.streaming.diloco_fragment_pattern = P, pattern
        local = builder.fragment_function(cfg, megatron_world)
        assert [local(n) for n in names] == [plan.fragment_of(n) for n in names]


def _stage_fragment_function(untie, P, pattern, pp_rank=1, pp=2, num_layers=4):
    cfg = Config()
    cfg.model.num_layers, cfg.model.untie_embeddings_and_output_weights = num_layers, untie
    cfg.streaming.diloco_fragments, cfg.streaming.diloco_fragment_pattern = P, pattern
    from megatron_streaming.parallel.topology import Topology

    topo = SimpleNamespace(pp_rank=pp_rank, layout=SimpleNamespace(pp=pp))
    topo.first_layer = lambda n: Topology.first_layer(topo, n)  # the stage's, as a rank's
    return builder.fragment_function(cfg, topo)


def test_last_stage_output_layer_follows_the_embedding_when_tied():
    # 4 layers, P = 4 strided: fragment = layer; embedding -> 0, last layer -> 3.
    tied = _stage_fragment_function(False, 4, "strided")
    untied = _stage_fragment_function(True, 4, "strided")
    assert tied("output_layer.weight") == 0
    assert untied("output_layer.weight") == 3
    # Sequential P = 2: layers {0, 1} -> 0, {2, 3} -> 1.
    assert _stage_fragment_function(False, 2, "sequential")("output_layer.weight") == 0
    assert _stage_fragment_function(True, 2, "sequential")("output_layer.weight") == 1


def test_stage_local_layer_names_map_by_global_index():
    f = _stage_fragment_function(True, 4, "strided")  # stage 1 of 2 holds layers 2 and 3
    assert f("decoder.layers.0.mlp.linear_fc1.weight") == 2
    assert f("decoder.layers.1.self_attention.linear_qkv.bias") == 3
    assert f("decoder.final_layernorm.weight") == 3
    seq = _stage_fragment_function(True, 2, "sequential")
    assert seq("decoder.layers.0.mlp.linear_fc1.weight") == 1
    first = _stage_fragment_function(True, 4, "strided", pp_rank=0)
    assert first("decoder.layers.1.mlp.linear_fc1.weight") == 1
    assert first("embedding.word_embeddings.weight") == 0
    eight = _stage_fragment_function(True, 4, "strided", pp_rank=3, pp=4, num_layers=8)
    assert eight("decoder.layers.1.input_layernorm.weight") == 7 % 4
