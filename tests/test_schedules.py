"""Schedules in-process: the learning rate against megatron-core's OptimizerParamScheduler,
batch ramp-up against megatron-core's micro-batch calculator, Megatron's iteration counts,
the flag rules, the --deepspeed_config merge and the W&B writer."""

import importlib.util
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_streaming.cli.arguments import ConfigError, parse_args, validate
from megatron_streaming.config.schedules import BatchSchedule, LrSchedule

MOCK = ["--mock-data", "--seq-length", "32"]


def _cfg(argv, world=1):
    cfg = parse_args([*MOCK, *argv])
    validate(cfg, world)
    return cfg


def _errors(argv, world=1):
    with pytest.raises(ConfigError) as err:
        _cfg(argv, world)
    return str(err.value).splitlines()


class _Constant:
    """The calculator interface for a constant batch (megatron-core's needs a world)."""

    def __init__(self, batch):
        self.batch = batch

    def update(self, consumed, consistency_check):
        pass

    def get_current_global_batch_size(self):
        return self.batch


def megatron_lrs(iterations, calculator, groups=None, **scheduler):
    """Megatron's loop: update the batch from the samples consumed, run the step with the lr
    the scheduler holds, then step the scheduler by the step's samples. ``groups``: Megatron's
    param groups (their own ``max_lr`` / ``min_lr``); returns each one's lr per step, or
    without them the scheduler's own."""
    given = groups is not None
    groups = groups if given else [{}]
    sched = OptimizerParamScheduler(SimpleNamespace(param_groups=groups), **{
        "start_wd": 0.0, "end_wd": 0.0, "wd_incr_steps": 1, "wd_incr_style": "constant",
        **scheduler})
    consumed, lrs = 0, []
    for _ in range(iterations):
        calculator.update(consumed, consistency_check=True)
        lrs.append([g["lr"] for g in groups] if given else groups[0]["lr"])
        batch = calculator.get_current_global_batch_size()
        sched.step(batch)
        consumed += batch
    return lrs


LR = ["--lr", "1e-3", "--min-lr", "1e-5"]
# (flags, the scheduler's warmup / decay / WSD lengths in samples as Megatron-LM's
# get_optimizer_param_scheduler derives them, by hand)
CASES = [
    *[(["--train-iters", "30", "--global-batch-size", "8", "--lr-warmup-iters", "5",
        "--lr-decay-style", style], dict(lr_warmup_steps=40, lr_decay_steps=240))
      for style in ("constant", "linear", "cosine", "inverse-square-root")],
    (["--train-iters", "30", "--global-batch-size", "8", "--lr-decay-iters", "20",
      "--lr-warmup-fraction", "0.1", "--lr-warmup-init", "1e-4", "--lr-decay-style", "cosine"],
     dict(lr_warmup_steps=0.1 * 160, lr_decay_steps=160, init_lr=1e-4)),
    *[(["--train-iters", "30", "--global-batch-size", "8", "--lr-warmup-iters", "3",
        "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "10", "--lr-wsd-decay-style", wsd],
       dict(lr_warmup_steps=24, lr_decay_steps=240, wsd_decay_steps=80, lr_wsd_decay_style=wsd))
      for wsd in ("exponential", "linear", "cosine", "minus_sqrt")],
    (["--train-samples", "240", "--global-batch-size", "8", "--lr-warmup-samples", "36",
      "--lr-decay-samples", "200", "--lr-decay-style", "cosine"],
     dict(lr_warmup_steps=36, lr_decay_steps=200)),
    (["--train-samples", "240", "--global-batch-size", "8", "--lr-warmup-fraction", "0.05"],
     dict(lr_warmup_steps=0.05 * 240, lr_decay_steps=240)),
    (["--train-samples", "240", "--global-batch-size", "8", "--lr-decay-style", "WSD",
      "--lr-wsd-decay-samples", "64", "--lr-wsd-decay-style", "minus_sqrt"],
     dict(lr_warmup_steps=0, lr_decay_steps=240, wsd_decay_steps=64,
          lr_wsd_decay_style="minus_sqrt")),
    # Megatron-DeepSpeed's token schedule is the same arithmetic in tokens (32 per sample).
    (["--train-samples", "240", "--global-batch-size", "8", "--lr-warmup-tokens", "1000",
      "--lr-decay-tokens", "6000", "--lr-decay-style", "cosine"],
     dict(lr_warmup_steps=1000, lr_decay_steps=6000, tokens=True)),
    (["--train-iters", "30", "--global-batch-size", "8", "--lr-warmup-iters", "2",
      "--lr-decay-tokens", "5000"], dict(lr_warmup_steps=2 * 8 * 32, lr_decay_steps=5000,
                                         tokens=True)),
]
RAMPUP = ["--global-batch-size", "16", "--micro-batch-size", "2", "--rampup-batch-size", "4",
          "4", "100"]
RAMPUP_CASES = [
    (["--train-samples", "400", *RAMPUP, "--lr-warmup-samples", "30",
      "--lr-decay-style", "cosine"], dict(lr_warmup_steps=30, lr_decay_steps=400)),
    # Iteration-based with a ramp (Megatron-LM's step schedules allow it): lengths are
    # iterations x the full batch, reached sooner by the samples of ramped steps.
    (["--train-iters", "40", *RAMPUP, "--lr-warmup-iters", "2"],
     dict(lr_warmup_steps=32, lr_decay_steps=640)),
]


@pytest.mark.parametrize("flags, lengths", CASES + RAMPUP_CASES,
                         ids=[" ".join(c[0]) for c in CASES + RAMPUP_CASES])
def test_lr_equals_megatron_optimizer_param_scheduler(flags, lengths):
    cfg = _cfg([*LR, *flags])
    t, o = cfg.training, cfg.optimizer
    lengths = dict(lengths)
    per_sample = 32 if lengths.pop("tokens", False) else 1
    if t.rampup_batch_size:
        calculator = RampupBatchsizeNumMicroBatchesCalculator(16, 2, 1, False, 1, 4, 4, 100)
    else:
        calculator = _Constant(8)
    if per_sample > 1:  # the scheduler counts tokens: scale the calculator's samples
        batch = calculator.get_current_global_batch_size
        calculator.get_current_global_batch_size = lambda: batch() * per_sample
    expected = megatron_lrs(t.train_iters, calculator, max_lr=1e-3, min_lr=1e-5,
                            lr_decay_style=o.lr_decay_style,
                            **{"init_lr": 0.0, **lengths})
    lr = LrSchedule(cfg, BatchSchedule(t, 32, 1))
    assert [lr(i) for i in range(t.train_iters)] == expected


DECOUPLED = [(["--decoupled-lr", "3e-3", "--decoupled-min-lr", "2e-4"], 3e-3, 2e-4),
             (["--decoupled-lr", "3e-3"], 3e-3, 1e-5)]  # the floor defaults to --min-lr


@pytest.mark.parametrize("decoupled, peak, floor", DECOUPLED, ids=["own_floor", "min_lr"])
@pytest.mark.parametrize("flags, lengths", [CASES[2], CASES[4], CASES[6], CASES[9]],
                         ids=["cosine", "warmup_init", "wsd", "samples"])
@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_decoupled_lr_equals_megatron_param_groups_and_scheduler(
        megatron_world, untie, flags, lengths, decoupled, peak, floor):
    """megatron-core's own param groups for the built model (``_get_param_groups`` with
    --decoupled-lr / --decoupled-min-lr) stepped by its OptimizerParamScheduler: every
    parameter has our group's weight decay and, at every step, our group's lr, exactly."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    from megatron_streaming.parallel import distributed
    from megatron_streaming.worker.engine import param_groups
    from megatron_streaming.worker.model import build_model

    cfg = _cfg([*LR, *flags, *decoupled, "--num-layers", "2", "--hidden-size", "32",
                "--num-attention-heads", "4", "--position-embedding-type", "learned_absolute",
                *(["--untie-embeddings-and-output-weights"] if untie else [])])
    t, o = cfg.training, cfg.optimizer
    distributed.seed_everything(1, 0)
    model = build_model(cfg.model, cfg.parallel, megatron_world, 500, None, cfg.precision)
    theirs = _get_param_groups([model], OptimizerConfig(
        lr=o.lr, min_lr=o.min_lr, decoupled_lr=o.decoupled_lr,
        decoupled_min_lr=o.decoupled_min_lr, weight_decay=o.weight_decay), None)
    ours = param_groups(model, o)
    assert [(g["max_lr"], g["min_lr"]) for g in ours] == [(1e-3, 1e-5)] * 2 + [(peak, floor)]
    lengths = dict(lengths)
    expected = megatron_lrs(t.train_iters, _Constant(8), theirs, max_lr=1e-3, min_lr=1e-5,
                            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay,
                            end_wd=o.weight_decay, **{"init_lr": 0.0, **lengths})
    lr = LrSchedule(cfg, BatchSchedule(t, 32, 1))
    got = [[lr(i, g["max_lr"], g["min_lr"]) for g in ours] for i in range(t.train_iters)]
    group_of = {id(p): i for i, g in enumerate(ours) for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    decoupled_names = set()
    for j, group in enumerate(theirs):
        for p in group["params"]:
            i = group_of.pop(id(p))
            assert group["weight_decay"] == ours[i]["weight_decay"], names[id(p)]
            assert [step[j] for step in expected] == [step[i] for step in got], names[id(p)]
            if group["max_lr"] == peak:
                decoupled_names.add(names[id(p)])
    assert not group_of  # the same parameters
    # Megatron's choice: the word embedding and the output layer, not position embeddings.
    assert decoupled_names == {"embedding.word_embeddings.weight",
                               *(["output_layer.weight"] if untie else [])}
    assert any(s[-1] != s[0] for s in got)  # the decoupled lr is not the regular one


class _Stage:
    """The world-1 topology posing as one pipeline stage (first, middle or last)."""

    def __init__(self, topology, first, last):
        self._t, self.is_first_stage, self.is_last_stage = topology, first, last

    def __getattr__(self, name):
        return getattr(self._t, name)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_every_stage_has_three_nonempty_groups_with_decoupled_lr(megatron_world, tied):
    """DeepSpeed needs the same group count on every stage and no empty group: a middle
    stage (PP >= 3) fills the decoupled group with one weight at the regular lr."""
    from megatron_streaming.parallel import distributed
    from megatron_streaming.worker.engine import param_groups
    from megatron_streaming.worker.model import build_model

    cfg = _cfg([*LR, "--decoupled-lr", "3e-3", "--decoupled-min-lr", "2e-4", "--num-layers",
                "2", "--hidden-size", "32", "--num-attention-heads", "4",
                *([] if tied else ["--untie-embeddings-and-output-weights"])])
    regular, decoupled = (1e-3, 1e-5), (3e-3, 2e-4)
    # megatron-core builds a single stage holding a tied embedding only with both ends.
    stages = {"first": (True, False, decoupled, ["embedding.word_embeddings.weight"]),
              "middle": (False, False, regular, ["decoder.layers.1.mlp.linear_fc2.weight"]),
              "last": (False, True, decoupled, ["output_layer.weight"])}
    for name, (first, last, bounds, third) in stages.items():
        if tied and not first and not last:
            continue
        distributed.seed_everything(1, 0)
        model = build_model(cfg.model, cfg.parallel, _Stage(megatron_world, first, last), 500,
                            None, cfg.precision)
        groups = param_groups(model, cfg.optimizer)
        names = {id(p): n for n, p in model.named_parameters()}
        assert [len(g["params"]) > 0 for g in groups] == [True] * 3, name
        assert [(g["max_lr"], g["min_lr"]) for g in groups] == [regular] * 2 + [bounds], name
        assert [names[id(p)] for p in groups[2]["params"]] == third, name
        assert groups[2]["weight_decay"] == cfg.optimizer.weight_decay
        assert sorted(names[id(p)] for g in groups for p in g["params"]) == sorted(
            n for n, p in model.named_parameters() if p.requires_grad), name
    groups = param_groups(model, _cfg(LR).optimizer)  # without --decoupled-lr: two groups
    assert [(g["max_lr"], g["min_lr"], g["sync_index"]) for g in groups] == [
        (1e-3, 1e-5, 0), (1e-3, 1e-5, 1)]


def test_lr_at_keeps_its_signature_and_megatron_warmup():
    """The first step of a warmup runs at --lr-warmup-init (0), as in Megatron."""
    from seams import lr_at

    cfg = parse_args([*MOCK, "--lr", "1.0", "--lr-warmup-iters", "4", "--train-iters", "10"])
    assert [lr_at(i, cfg) for i in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]


# ---- batch ramp-up and training length ------------------------------------------------------

@pytest.mark.parametrize("ramp, gbs, mbs, dp, iterations", [
    ((4, 4, 100), 16, 2, 1, 60), ((2, 2, 7), 10, 1, 2, 40), ((3, 3, 1000), 30, 3, 1, 200),
    ((16, 16, 5859375), 1536, 1, 16, 25000)])  # GPT-3 175B's ramp
def test_rampup_follows_megatron_calculator_every_iteration(ramp, gbs, mbs, dp, iterations):
    calculator = RampupBatchsizeNumMicroBatchesCalculator(gbs, mbs, dp, False, 1, *ramp)
    t = SimpleNamespace(micro_batch_size=mbs, global_batch_size=gbs, rampup_batch_size=list(ramp),
                        step_batch_size_schedule=None)
    batches = BatchSchedule(t, 2048, dp)
    consumed = 0
    for i in range(iterations):
        calculator.update(consumed, consistency_check=True)
        assert batches.consumed(i) == consumed
        assert batches.micro_batches(i) == calculator.get()
        assert batches.global_batch(i) == calculator.get_current_global_batch_size()
        consumed += calculator.get_current_global_batch_size()
    assert len(batches.segments) <= (gbs - ramp[0]) // ramp[1] + 1


def _megatron_rampup_iters(ramp, gbs, train_samples):
    """Megatron's update_train_iters for a ramp (Megatron-LM up to the step schedules, and
    Megatron-DeepSpeed): the ramp's iterations, then whole final batches."""
    calculator = RampupBatchsizeNumMicroBatchesCalculator(gbs, 1, 1, False, 1, *ramp)
    iterations = consumed = 0
    while consumed <= ramp[2]:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    return iterations + (train_samples - consumed) // gbs


@pytest.mark.parametrize("ramp, gbs, samples", [
    ((4, 4, 100), 16, 400), ((2, 2, 12), 8, 46), ((16, 16, 5859375), 1536, 300_000_000)])
def test_train_samples_to_iterations_as_megatron(ramp, gbs, samples):
    cfg = _cfg(["--train-samples", str(samples), "--global-batch-size", str(gbs),
                "--micro-batch-size", "1", "--rampup-batch-size", *map(str, ramp)])
    assert cfg.training.train_iters == _megatron_rampup_iters(ramp, gbs, samples)
    assert _cfg(["--train-samples", "100", "--global-batch-size", "8"]).training.train_iters == 12


def test_step_batch_size_schedule_in_tokens():
    """Megatron-LM's GPT-3 175B example: thresholds in tokens, // --seq-length -> samples."""
    t = SimpleNamespace(micro_batch_size=1, global_batch_size=None, rampup_batch_size=None,
                        step_batch_size_schedule="0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536")
    batches = BatchSchedule(t, 2048, 16)
    # 2.4e9 // 2048 = 1171875 samples: batch 16 for ceil(1171875 / 16) = 73243 steps.
    assert batches.segments[:2] == [(0, 0, 16), (73243, 73243 * 16, 320)]
    assert batches.final_batch == 1536 and batches.micro_batches(0) == 1
    # Megatron-LM's update_train_iters for a step schedule: steps until the samples are reached.
    consumed = iterations = 0
    while consumed < 9_000_000:
        consumed += batches.global_batch(iterations)
        iterations += 1
    assert batches.iterations_for_samples(9_000_000) == iterations
    cfg = _cfg(["--micro-batch-size", "2", "--step-batch-size-schedule", "0:4 256:8",
                "--train-iters", "5"], world=2)
    assert cfg.training.global_batch_size == 8  # the last entry
    engine_batches = BatchSchedule(cfg.training, 32, 2)  # 256 tokens = 8 samples
    assert [engine_batches.micro_batches(i) for i in range(5)] == [1, 1, 2, 2, 2]


def test_train_tokens_caps_iterations_and_keeps_the_decay():
    # 8 samples x 32 tokens a step: 1000 tokens are reached after 4 steps (1024).
    cfg = _cfg(["--train-iters", "20", "--global-batch-size", "8", "--train-tokens", "1000"])
    assert cfg.training.train_iters == 4
    assert cfg.optimizer.lr_decay_iters == 20  # Megatron-DeepSpeed: decay over --train-iters
    cfg = _cfg(["--train-samples", "100", "--global-batch-size", "8", "--train-tokens", "1000"])
    assert cfg.training.train_iters == 4
    validate(cfg, 1)  # idempotent
    assert cfg.training.train_iters == 4 and cfg.optimizer.lr_decay_iters is None


def test_consumed_samples_are_a_function_of_the_iteration():
    cfg = _cfg(["--train-samples", "46", "--global-batch-size", "8", "--rampup-batch-size",
                "2", "2", "12", "--diloco-workers", "2"], world=2)  # per worker
    batches = BatchSchedule(cfg.training, 32, 1)
    assert [batches.global_batch(i) for i in range(8)] == [2, 2, 4, 6, 8, 8, 8, 8]
    assert [batches.consumed(i) for i in range(9)] == [0, 2, 4, 8, 14, 22, 30, 38, 46]
    assert cfg.training.train_iters == 8


@pytest.mark.parametrize("argv, world, line", [
    (["--train-iters", "10", "--train-samples", "100"], 1,
     "--train-iters and --train-samples are exclusive: give one (iteration-based or "
     "sample-based training, as in Megatron-LM)"),
    (["--train-samples", "100", "--lr-decay-iters", "5"], 1,
     "--lr-decay-iters does not go with sample-based training (--train-samples); use "
     "--lr-decay-samples"),
    (["--train-samples", "100", "--lr-warmup-iters", "5"], 1,
     "--lr-warmup-iters does not go with sample-based training (--train-samples); use "
     "--lr-warmup-samples"),
    (["--lr-warmup-samples", "4"], 1, "--lr-warmup-samples does not go with iteration-based "
     "training (--train-iters); use --lr-warmup-iters"),
    (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], 1,
     "--lr-warmup-iters and --lr-warmup-fraction: give only one warmup length"),
    (["--train-tokens", "1000"], 1, "--train-tokens needs --train-iters or --train-samples "
     "(it stops training early, as in Megatron-DeepSpeed)"),
    (["--lr-warmup-tokens", "100"], 1, "--lr-warmup-tokens needs --lr-decay-tokens "
     "(token-based schedules, as in Megatron-DeepSpeed)"),
    (["--lr-decay-tokens", "100", "--lr-decay-iters", "3"], 1,
     "--lr-decay-tokens and --lr-decay-iters: give only one decay length"),
    (["--lr-decay-style", "WSD"], 1, "--lr-decay-style WSD needs --lr-wsd-decay-iters (the "
     "length of its annealing phase)"),
    (["--global-batch-size", "8", "--rampup-batch-size", "3", "2", "10"], 1,
     "--rampup-batch-size 3 2 10: --global-batch-size (8) minus the start batch must be a "
     "positive multiple of the increment"),
    (["--global-batch-size", "8", "--rampup-batch-size", "2", "2", "10"], 2,
     "--rampup-batch-size: the global batch 2 (from sample 0) is not divisible by "
     "--micro-batch-size (2) x data-parallel size (2)"),
    (["--global-batch-size", "8", "--rampup-batch-size", "4", "4", "10",
      "--step-batch-size-schedule", "0:4"], 1,
     "--rampup-batch-size and --step-batch-size-schedule are exclusive: give one"),
    (["--global-batch-size", "8", "--step-batch-size-schedule", "0:4 1K:16"], 1,
     "--step-batch-size-schedule and --global-batch-size are exclusive (the schedule's last "
     "batch is the global batch size, as in Megatron-LM)"),
    (["--step-batch-size-schedule", "64:4"], 1,
     "--step-batch-size-schedule '64:4': the first threshold must be 0"),
    (["--step-batch-size-schedule", "0:4 1x:8"], 1, "--step-batch-size-schedule entry '1x:8': "
     "'1x' is not a number (K/M/B/T suffixes allowed)"),
    (["--train-samples", "3", "--global-batch-size", "4"], 1,
     "--train-samples 3 is less than one global batch (4)"),
    (["--lr", "0.1", "--min-lr", "1"], 1, "--min-lr (1.0) must not exceed --lr (0.1)"),
    (["--decoupled-min-lr", "1e-4"], 1, "--decoupled-min-lr 0.0001 needs --decoupled-lr (the "
     "embedding and output layer's peak learning rate)"),
    (["--decoupled-lr", "-1"], 1, "--decoupled-lr must be >= 0, got -1.0"),
    (["--decoupled-lr", "1e-3", "--decoupled-min-lr", "1e-2"], 1, "--decoupled-min-lr (0.01) "
     "must be in [0, --decoupled-lr (0.001)]: the floor of the embedding and output layer's "
     "decay"),
    (["--min-lr", "1e-4", "--decoupled-lr", "5e-5"], 1, "--min-lr (0.0001) must be in [0, "
     "--decoupled-lr (5e-05)]: the floor of the embedding and output layer's decay"),
    (["--exit-duration-in-mins", "0"], 1, "--exit-duration-in-mins must be > 0, got 0.0"),
    (["--wandb-project", "p"], 1, "--wandb-project p needs --wandb-exp-name (the run's name, "
     "as in Megatron-LM)"),
])
def test_schedule_flag_rules_are_one_line(argv, world, line):
    assert _errors(argv, world) == [line]


def test_megatron_scripts_schedule_flags_are_accepted():
    """The schedule flags of the public scripts (tests/public_scripts.py): Megatron-LM's
    Llama 3 (samples), Megatron-DeepSpeed's GPT 1.3B (tokens and samples) at a small scale."""
    cfg = _cfg(["--train-samples", "1953", "--lr-decay-samples", "1949", "--lr-warmup-samples",
                "39", "--global-batch-size", "8", "--exit-duration-in-mins", "235"])
    assert cfg.training.train_iters == 1953 // 8
    cfg = _cfg(["--lr-decay-tokens", "300000", "--lr-warmup-tokens", "3000",
                "--train-tokens", "300000", "--train-samples", str(300000 * 2 // 32),
                "--global-batch-size", "8", "--exit-duration-in-mins", "30000000"])
    assert cfg.training.train_iters == -(-300000 // (32 * 8))  # the step that passes it


# ---- --deepspeed_config ----------------------------------------------------------------------

def _json(tmp_path, config, name="ds_config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def test_megatron_deepspeed_llama_json_sets_the_flags_not_given(tmp_path):
    """examples_deepspeed/pretrain_llama*_distributed.sh's JSON, with none of its flags given."""
    from megatron_streaming.worker.engine import deepspeed_config

    path = _json(tmp_path, {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                            "steps_per_print": 1, "zero_optimization": {"stage": 1},
                            "bf16": {"enabled": True}, "wall_clock_breakdown": False,
                            "timers": {"throughput": {"enabled": True}}})
    cfg = _cfg(["--deepspeed_config", path, "--deepspeed"], world=8)
    t = cfg.training
    assert (t.micro_batch_size, t.global_batch_size, cfg.parallel.zero_stage) == (4, 32, 1)
    assert any(n.startswith('--deepspeed_config: "bf16.enabled": true sets --bf16')
               for n in cfg.notes)
    ds = deepspeed_config(cfg)
    assert ds["steps_per_print"] == 1
    assert ds["timers"] == {"throughput": {"enabled": True}}  # ours off; a user's JSON may ask
    assert ds["bf16"] == {"enabled": True, "immediate_grad_update": True}
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}  # as Megatron-LM accumulates bf16
    assert "train_batch_size" not in ds  # DeepSpeed gets micro x DP; the schedule accumulates
    assert ds["gradient_accumulation_steps"] == 1 and ds["train_micro_batch_size_per_gpu"] == 4


def test_megatron_deepspeed_gpt_json_with_its_script_flags(tmp_path):
    """examples_deepspeed/rebase/ds_pretrain_gpt_1.3B.sh's JSON (fp16, clipping, prescale) with
    the flags the script also passes: everything agrees; DeepSpeed-only keys pass through."""
    from megatron_streaming.worker.engine import deepspeed_config

    user = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10,
            "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e8},
            "gradient_clipping": 1.0, "prescale_gradients": True,
            "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500,
                     "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 11},
            "wall_clock_breakdown": False, "flops_profiler": {"enabled": False}}
    path = _json(tmp_path, user)
    argv = ["--micro-batch-size", "2", "--global-batch-size", "16", "--clip-grad", "1.0",
            "--zero-stage", "0", "--deepspeed_config", path]
    if not hasattr(parse_args(MOCK), "precision"):  # no --fp16 in this tree: one line
        assert _errors(argv, 4) == [f'--deepspeed_config {path}: "fp16.enabled": true asks '
                                    "for --fp16, which this pretrain_gpt.py does not have"]
        return
    cfg = _cfg([*argv, "--fp16", "--hysteresis", "2"], world=4)
    p = cfg.precision
    assert (p.fp16, p.initial_loss_scale, p.loss_scale_window, p.min_loss_scale) == \
        (True, 2.0 ** 11, 500, 1)
    ds = deepspeed_config(cfg)
    assert ds["zero_optimization"] == {"stage": 0, "overlap_comm": False,
                                       "reduce_bucket_size": 5e8}
    assert ds["prescale_gradients"] and ds["flops_profiler"] == {"enabled": False}
    assert ds["fp16"]["initial_scale_power"] == 11 and ds["steps_per_print"] == 10


def test_deepspeed_json_overlap_comm_at_stage_1_runs_without_it(tmp_path):
    """``"overlap_comm": true`` at stage 1 (DeepSpeed refuses it with the schedule owning the
    micro-batches) sets --overlap-grad-reduce, which runs as stage 1 can: without overlap,
    noted; at stage 2 it is passed on."""
    from megatron_streaming.worker.engine import deepspeed_config

    for stage, overlap in ((1, False), (2, True)):
        path = _json(tmp_path, {"zero_optimization": {"stage": stage, "overlap_comm": True}},
                     f"stage{stage}.json")
        cfg = _cfg(["--deepspeed_config", path], world=2)
        assert '--deepspeed_config: "zero_optimization.overlap_comm": true sets ' \
            "--overlap-grad-reduce" in cfg.notes
        assert deepspeed_config(cfg)["zero_optimization"] == {"stage": stage,
                                                              "overlap_comm": overlap}
        assert [a.split(":")[0] for a in cfg.adjustments] == \
            ([] if overlap else ["--overlap-grad-reduce at --zero-stage 1 "
                                 "(--use-distributed-optimizer is stage 1)"])


def test_deepspeed_json_conflicts_name_key_value_flag_and_value(tmp_path):
    path = _json(tmp_path, {"train_micro_batch_size_per_gpu": 4, "train_batch_size": 32,
                            "zero_optimization": {"stage": 3}, "gradient_clipping": 0.5,
                            "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
                            "zero_optimization.x": 1,
                            "bf16": {"enabled": False}})
    lines = _errors(["--micro-batch-size", "2", "--global-batch-size", "8", "--clip-grad", "1",
                     "--bf16", "--deepspeed-config", path])
    p = f"--deepspeed_config {path}:"
    assert lines == [
        f'{p} "train_micro_batch_size_per_gpu": 4 vs --micro-batch-size 2',
        f'{p} "train_batch_size": 32 vs --global-batch-size 8',
        f'{p} "zero_optimization.stage": 3: ZeRO stage 3 is not supported here (0, 1 or 2)',
        f'{p} "gradient_clipping": 0.5 vs --clip-grad 1.0',
        f'{p} "optimizer": the inner optimizer comes from --optimizer, --lr, --adam-beta1/2, '
        "--adam-eps and --weight-decay; drop the key",
        f'{p} "bf16.enabled": false vs --bf16']


@pytest.mark.parametrize("config, line", [
    ({"managed_gradient_accumulation": True}, '"managed_gradient_accumulation": true: '
     "generated as false (Megatron's schedule runs the micro-batches and DeepSpeed only "
     "steps); drop the key"),
    ({"gradient_accumulation_steps": 4}, '"gradient_accumulation_steps": 4 vs the '
     "micro-batches per step: --global-batch-size 8 / (--micro-batch-size 2 x data-parallel "
     "size 2) = 2"),
    ({"scheduler": {"type": "WarmupLR"}}, '"scheduler": the learning-rate schedule comes from '
     "the --lr-* flags; drop the key"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     '"zero_optimization.offload_optimizer": ZeRO-Offload is not supported; drop the key'),
])
def test_deepspeed_json_generated_and_refused_keys(tmp_path, config, line):
    path = _json(tmp_path, config)
    assert _errors(["--global-batch-size", "8", "--deepspeed_config", path], world=2) == \
        [f"--deepspeed_config {path}: {line}"]


def test_deepspeed_json_that_agrees_or_is_off_passes(tmp_path):
    path = _json(tmp_path, {"gradient_accumulation_steps": 2, "zero_allow_untested_optimizer":
                            True, "zero_optimization": {"offload_optimizer": {"device": "none"}},
                            "amp": {"enabled": False}})
    _cfg(["--global-batch-size", "8", "--deepspeed_config", path], world=2)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    (line,) = _errors(["--deepspeed_config", str(bad)])
    assert line.startswith(f"--deepspeed_config {bad}: cannot read it as JSON: ")


# ---- W&B -----------------------------------------------------------------------------------

def _fake_wandb():
    spec = importlib.util.spec_from_file_location(
        "wandb", Path(__file__).parent / "fake_wandb" / "wandb.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wandb_writer_logs_the_same_scalars(tmp_path, monkeypatch):
    from megatron_streaming.run.metrics import make_writer

    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb())
    monkeypatch.setenv("FAKE_WANDB_LOG", str(tmp_path / "calls.jsonl"))
    cfg = parse_args([*MOCK, "--wandb-project", "proj", "--wandb-exp-name", "run1", "--save",
                      str(tmp_path / "ckpt"), "--log-jsonl", str(tmp_path / "log.jsonl")])
    writer = make_writer(cfg.logging, True, cfg)
    writer.scalars(3, {"lm loss": 2.5, "grad-norm": None}, samples=24,
                   legacy={"train/loss": 2.5})
    writer.scalars(3, {}, legacy={"timers/optimizer-time": 1.0})  # nothing for W&B
    writer.close()
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [c["call"] for c in calls] == ["init", "log", "finish"]
    assert (calls[0]["project"], calls[0]["name"], calls[0]["dir"]) == \
        ("proj", "run1", str(tmp_path / "ckpt" / "wandb"))  # Megatron's default: --save/wandb
    assert "training" in calls[0]["config_keys"]
    # Megatron-LM's keys, and its "samples vs steps"; the old names stay out of W&B.
    assert calls[1] == {"call": "log", "data": {"lm loss": 2.5, "samples vs steps": 24},
                        "step": 3}
    assert [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()] \
        == [{"iteration": 3, "lm loss": 2.5, "grad-norm": None, "train/loss": 2.5,
             "samples vs steps": 24},
            {"iteration": 3, "timers/optimizer-time": 1.0}]
    assert not make_writer(cfg.logging, False, cfg)._writers  # only the logging rank writes


def test_wandb_missing_is_one_line_and_no_crash(tmp_path, monkeypatch, caplog):
    from megatron_streaming.run.metrics import make_writer

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = parse_args([*MOCK, "--wandb-project", "proj", "--wandb-exp-name", "run1"])
    with caplog.at_level(logging.INFO, logger="megatron_streaming"):
        writer = make_writer(cfg.logging, True, cfg)
        writer.scalars(1, {"lm loss": 1.0})
        writer.close()
    assert [r.getMessage() for r in caplog.records] == [
        "--wandb-project proj: wandb is not installed, so nothing goes to W&B; install it "
        "with: .venv/bin/pip install wandb==0.31.0"]
