"""Megatron-LM / Megatron-DeepSpeed flags: accepted, mapped or refused one line each, and
lenient where Megatron is lenient. In-process (parse_args + validate), no training."""

import pytest

from megatron_streaming.cli import megatron_flags
from megatron_streaming.cli.arguments import ConfigError, parse_args, validate

MOCK = ["--mock-data"]


def _errors(argv):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    return str(err.value).splitlines()


def test_unknown_flags_are_named_one_line_each_with_a_suggestion():
    lines = _errors([*MOCK, "--foo", "3", "--num-layer", "3", "--hidden-size", "64", "7"])
    assert len(lines) == 3, lines
    assert lines[0].startswith("unrecognized argument --foo: not a flag of this ")
    assert lines[1].endswith("did you mean --num-layers?")
    assert lines[2] == "unexpected value '7' (no flag before it takes a value)"


def test_a_bad_value_is_one_line_without_the_usage():
    assert _errors([*MOCK, "--num-layers", "x"]) == [
        "argument --num-layers: invalid int value: 'x'"]


def test_refused_flags_say_what_to_use_instead():
    lines = _errors([*MOCK, "--data-impl", "lazy", "--use-tutel",
                     "--num-layers-per-virtual-pipeline-stage", "2", "--tp-comm-overlap"])
    assert lines == [
        "--data-impl lazy: only mmap indexed datasets exist here; use --data-impl mmap (or "
        "drop the flag)",
        "--num-layers-per-virtual-pipeline-stage: the interleaved pipeline schedule is not "
        "supported; use --pipeline-model-parallel-size alone",
        "--tp-comm-overlap: needs Transformer Engine's userbuffers; --ladder-residual overlaps "
        "the tensor-parallel all-reduce instead",
        "--use-tutel: Tutel's kernels are DeepSpeed-MoE's; megatron-core's MoE layer runs "
        "here: drop the flag"]


def test_accepted_flags_change_nothing_and_are_noted():
    plain = parse_args(MOCK)
    cfg = parse_args([*MOCK, "--use-mcore-models", "--data-impl", "mmap",
                      "--no-query-key-layer-scaling", "--deepspeed", "--mlp-type", "standard",
                      "--no-masked-softmax-fusion", "--num-workers", "2"])
    assert [section for _, section in cfg.sections()] == \
        [section for _, section in plain.sections()]
    assert any(n.startswith("--use-mcore-models: accepted") for n in cfg.notes)
    assert len(cfg.notes) == 7


@pytest.mark.parametrize("argv, check", [
    (["--use-distributed-optimizer", "--zero-stage", "2"],
     lambda c: c.parallel.zero_stage == 2),
    (["--use-distributed-optimizer"], lambda c: c.parallel.zero_stage == 1),
    (["--use-rotary-position-embeddings", "--no-position-embedding"],
     lambda c: c.model.position_embedding_type == "rope"),
    (["--no-position-embedding"], lambda c: c.model.position_embedding_type == "none"),
    (["--num-key-value-heads", "2", "--num-attention-heads", "8"],
     lambda c: c.model.query_groups() == 2),
    (["--context-parallel-size", "2"], lambda c: c.parallel.ds_sequence_parallel_size == 2),
    (["--context-parallel-size", "1"], lambda c: c.parallel.ds_sequence_parallel_size == 1),
    (["--overlap-grad-reduce"], lambda c: c.parallel.overlap_grad_reduce),
    (["--normalization", "rmsnorm"], lambda c: c.model.normalization == "RMSNorm"),
    (["--layernorm-epsilon", "1e-6"], lambda c: c.model.norm_epsilon == 1e-6),
    *[([flag], lambda c: c.model.attention_backend == "flash")
      for flag in ("--use-flash-attn", "--use-flash-attn-v2", "--use-flash-attn-triton")],
    (["--attention-backend", "flash", "--use-flash-attn"],
     lambda c: c.model.attention_backend == "flash"),
])
def test_mapped_flags_set_our_equivalent(argv, check):
    assert check(parse_args([*MOCK, *argv]))


def test_distributed_optimizer_conflicts_with_zero_stage_0():
    assert _errors([*MOCK, "--use-distributed-optimizer", "--zero-stage", "0"]) == [
        "--use-distributed-optimizer: shards the optimizer state, which --zero-stage 0 does "
        "not; drop one of the two"]


def test_lenient_where_megatron_is():
    cfg = parse_args([*MOCK, "--sequence-parallel", "--distributed-backend", "nccl"])
    validate(cfg, 1)
    assert not cfg.parallel.sequence_parallel
    assert cfg.parallel.distributed_backend == "gloo"  # no GPU here
    assert len(cfg.adjustments) == 2


def test_overlap_grad_reduce_below_zero_2_runs_as_without_it_with_a_note():
    """Megatron-LM's Llama-3 script passes --use-distributed-optimizer --overlap-grad-reduce:
    at ZeRO-1 DeepSpeed reduces once, in its step, and refuses overlap_comm; the run gets the
    very DeepSpeed config it would get without the flag, and says so in one line."""
    from megatron_streaming.worker.engine import deepspeed_config

    def validated(*argv):
        cfg = parse_args([*MOCK, *argv])
        validate(cfg, 2)
        return cfg

    for flags in (["--use-distributed-optimizer"], ["--zero-stage", "0"]):
        cfg = validated(*flags, "--overlap-grad-reduce")
        assert not cfg.parallel.overlap_grad_reduce
        assert deepspeed_config(cfg) == deepspeed_config(validated(*flags))
        (note,) = cfg.adjustments
        assert note.startswith(f"--overlap-grad-reduce at --zero-stage "
                               f"{cfg.parallel.zero_stage} (--use-distributed-optimizer is "
                               "stage 1): the gradients are reduced once, in the optimizer step")
    cfg = validated("--zero-stage", "2", "--overlap-grad-reduce")
    assert deepspeed_config(cfg)["zero_optimization"]["overlap_comm"] is True
    assert not cfg.adjustments


def test_gpu_only_features_are_refused_on_cpu_one_line_each():
    """FP8 needs Transformer Engine on a GPU; every attention backend runs anywhere (flash and
    fused: torch's fused attention on the local layers)."""
    cfg = parse_args([*MOCK, "--attention-backend", "fused", "--fp8-format", "hybrid"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    lines = str(err.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["--fp8-format hybrid"]
    assert all("needs Transformer Engine on a GPU" in line for line in lines)
    for backend in ("auto", "flash", "fused", "unfused", "local"):
        validate(parse_args([*MOCK, "--attention-backend", backend]), 1)


def test_flash_flags_conflict_with_another_backend_and_local_with_te_layers():
    assert _errors([*MOCK, "--attention-backend", "unfused", "--use-flash-attn-v2"]) == [
        "--use-flash-attn-v2: conflicts with --attention-backend unfused; drop one of the two"]
    with pytest.raises(ConfigError, match="--attention-backend local is megatron-core's own"):
        validate(parse_args([*MOCK, "--attention-backend", "local", "--transformer-impl",
                             "transformer_engine"]), 1)


def test_every_foreign_flag_is_distinct_from_our_own():
    from megatron_streaming.cli.arguments import build_parser

    ours = {s for a in build_parser()._actions for s in a.option_strings
            if not a.dest.startswith("megatron__")}
    assert not ours & set(megatron_flags.BY_FLAG)
    assert len(megatron_flags.BY_FLAG) == len(megatron_flags.FLAGS)


def test_fp32_gradient_accumulation_flag_is_megatrons_default_here():
    """Megatron-LM's --accumulate-allreduce-grads-in-fp32 is what --bf16 does here (ZeRO 1
    and 2): accepted; with --fp16 or --grad-reduce-in-bf16 it cannot hold: refused."""
    from megatron_streaming.worker.engine import deepspeed_config

    cfg = parse_args([*MOCK, "--bf16", "--accumulate-allreduce-grads-in-fp32"])
    validate(cfg, 1)
    assert deepspeed_config(cfg)["data_types"] == {"grad_accum_dtype": "fp32"}
    assert _errors([*MOCK, "--fp16", "--accumulate-allreduce-grads-in-fp32"]) == [
        "--accumulate-allreduce-grads-in-fp32: fp16 gradients accumulate in fp16 here "
        "(DeepSpeed's fp32 accumulation of fp16 is not wired); drop the flag"]
    assert _errors([*MOCK, "--bf16", "--grad-reduce-in-bf16",
                    "--accumulate-allreduce-grads-in-fp32"]) == [
        "--accumulate-allreduce-grads-in-fp32: conflicts with --grad-reduce-in-bf16; drop one "
        "of the two"]


def test_bf16_without_zero_says_its_gradients_accumulate_in_bf16():
    cfg = parse_args([*MOCK, "--bf16", "--zero-stage", "0"])
    validate(cfg, 1)
    assert any(a.startswith("--bf16 at --zero-stage 0: gradients accumulate over micro-batches "
                            "in bf16") for a in cfg.adjustments)
    cfg = parse_args([*MOCK, "--bf16"])
    validate(cfg, 1)
    assert not any(a.startswith("--bf16 at --zero-stage 0") for a in cfg.adjustments)
