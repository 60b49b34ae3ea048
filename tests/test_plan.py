"""The planner (``python -m megatron_streaming.plan``): its parameter counts against the door's
formula, the memory model's terms moving the way the code's memory does, and a whole plan
for the example clusters whose sbatch lines pretrain_gpt.py accepts as they are."""

import dataclasses
import re
import shlex

import pytest

from megatron_streaming.cli.arguments import parse_args, validate
from megatron_streaming.config.shape import parameter_count
from megatron_streaming.plan.__main__ import main
from megatron_streaming.plan.memory import Layout, ModelShape, Training, estimate

CLUSTERS = ["--cluster", "launch/clusters/h100_64.yaml", "--cluster",
            "launch/clusters/a100_32.yaml", "--link", "launch/clusters/link_10g_80ms.yaml"]
MODEL = ["--mock-data", "--vocab-size", "32000", "--num-layers", "24", "--hidden-size", "2048",
         "--num-attention-heads", "16", "--seq-length", "2048", "--global-batch-size", "512",
         "--train-iters", "20000", "--bf16"]


@pytest.mark.parametrize("flags", [
    [],
    ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu",
     "--group-query-attention", "--num-query-groups", "4", "--disable-bias-linear",
     "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "5504"],
])
def test_parameters_match_the_door_and_add_up_over_stages(flags):
    cfg = parse_args([*MODEL, *flags])
    shape = ModelShape.from_config(cfg.model, 32000)
    assert shape.parameters() == parameter_count(cfg.model, 32000)
    for pp in (1, 2, 4):
        stages = sum(shape.stage_parameters(1, pp, s) for s in range(pp))
        copy = shape.vocab * shape.hidden if shape.tied and pp > 1 else 0
        assert stages == pytest.approx(shape.parameters() + copy)


def test_memory_terms_move_with_the_layout():
    cfg = parse_args(MODEL)
    shape = ModelShape.from_config(cfg.model, 32000)
    t = Training("bf16", global_batch=64)

    def parts(**kw):
        return estimate(shape, Layout(**kw), t).parts

    zero0, zero1, zero2 = (parts(dp=8, zero_stage=z, micro_batch=2) for z in (0, 1, 2))
    assert zero1["optimizer"] == pytest.approx(zero0["optimizer"] / 8)  # master + Adam
    # bf16 gradients in bf16 at ZeRO-0, in fp32 under ZeRO (whole at 1, partitioned at 2)
    params = shape.stage_parameters(1, 1, 0)
    assert (zero0["gradients"], zero1["gradients"]) == (2 * params, 4 * params)
    assert zero2["gradients"] == pytest.approx(4 * params / 8)
    assert zero1["outer state"] == pytest.approx(zero0["outer state"] / 8)
    plain, recompute = parts(tp=2, micro_batch=4), parts(tp=2, micro_batch=4, recompute="full")
    assert recompute["activations"] < plain["activations"] / 4
    tp1, tp2 = parts(micro_batch=2), parts(tp=2, micro_batch=2)
    assert tp2["weights"] < tp1["weights"] and tp2["activations"] < tp1["activations"]
    offloaded = estimate(shape, Layout(), Training("bf16", 64, offload_outer_state=True))
    assert offloaded.parts["outer state"] < estimate(shape, Layout(), t).parts["outer state"]


def test_deepspeeds_reduce_bucket_and_the_exchange_are_counted_where_they_live():
    """DeepSpeed allocates its whole reduce bucket (5e8 elements of the weights' dtype, two
    with overlap_comm) at the first backward on CUDA, whatever the model's size; the sync's
    exchange holds the mean it returns and its chunk sums on the outer state's device."""
    from megatron_streaming.plan.memory import EXCHANGE_BYTES, REDUCE_BUCKET

    shape = ModelShape.from_config(parse_args(MODEL).model, 32000)

    def parts(layout=Layout(zero_stage=2), **kw):
        return estimate(shape, layout, Training("bf16", global_batch=8, **kw)).parts

    assert parts()["reduce bucket"] == REDUCE_BUCKET * 2
    assert parts(overlap_comm=True)["reduce bucket"] == REDUCE_BUCKET * 2 * 2
    assert "reduce bucket" not in parts(device="cpu")
    assert "reduce bucket" not in parts(Layout(zero_stage=0))
    # bf16 at ZeRO-1 runs BF16_Optimizer (fp32 accumulation), which has no reduce bucket;
    # with --grad-reduce-in-bf16 it is DeepSpeed's ZeRO optimizer again
    assert "reduce bucket" not in parts(Layout(zero_stage=1))
    assert parts(Layout(zero_stage=1), grad_reduce_in_bf16=True)["reduce bucket"] == \
        REDUCE_BUCKET * 2
    partition = shape.stage_parameters(1, 1, 0)
    one, three = parts(fragments=1), parts(fragments=3)
    assert one["outer state"] == pytest.approx(  # theta_g, momentum, exchange, its delta
        (8 + EXCHANGE_BYTES + 4) * partition)
    # offloaded, all of it is in host memory (the codec runs there): none on the device
    assert parts(fragments=1, offload_outer_state=True)["outer state"] == 0
    assert one["outer state"] - three["outer state"] == pytest.approx(
        (EXCHANGE_BYTES + 4) * partition * 2 / 3)  # a third of the exchange and its delta


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_layout_flags_are_megatrons_and_the_launch_accepts_them(recompute):
    """A layout's recompute becomes Megatron's flags (selective: the core attention), which
    pretrain_gpt.py's own checks accept; a name the planner does not know is refused."""
    layout = Layout(tp=2, pp=2, dp=2, micro_batch=2, recompute=recompute)
    cfg = parse_args([*MODEL, *layout.flags()])
    assert cfg.model.recompute_granularity == (None if recompute == "none" else recompute)
    validate(cfg, layout.ranks)
    assert layout.describe().endswith("micro-batch 2" if recompute == "none"
                                      else f"{recompute} recompute")
    with pytest.raises(ValueError, match="recompute 'yes': choose from none, selective, full"):
        Layout(recompute="yes")


def test_candidates_within_the_tie_of_the_fastest_go_to_the_least_memory():
    """Speeds within 0.5 % of the fastest that fits are a tie, however they fall against
    any rounding: the least memory wins, then the fewest ranks per replica, then the least
    recompute; then the rest by speed; those that do not fit last."""
    from megatron_streaming.plan.search import Candidate, order

    def cand(tokens, memory, why_not="", **kw):
        return Candidate(Layout(**kw), memory, 1.0, tokens, why_not)

    fastest = cand(1000.0, 18.0)
    lean = cand(997.6, 10.0)  # 0.24 % slower
    leaner_but_slow = cand(990.0, 5.0)  # 1 % slower
    too_big = cand(2000.0, 1.0, "needs 99 GiB")
    full = cand(999.0, 10.0, recompute="full")
    selective = cand(999.0, 10.0, recompute="selective")
    ranked = order([fastest, too_big, leaner_but_slow, full, lean, selective])
    assert ranked == [lean, selective, full, fastest, leaner_but_slow, too_big]


def test_attention_and_dropout_terms_follow_the_kernels_each_device_runs():
    """What autograd saves per layer (benchmarks/memory_phases.py lists it): per score, the
    fp32 softmax output and the probabilities the context keeps (dropped out, with a bool
    mask on CUDA and a mask of the activations' width on the CPU; or cast, the softmax
    itself in fp32); per token two residual dropout masks of the same width; flash: no
    scores. The backward holds the scores' gradients (e + 4 + 4 bytes each) or the logits,
    the larger, after the stored activations; a recomputed layer adds its own set."""
    shape = ModelShape.from_config(parse_args(MODEL).model, 32000)
    a, s, h, b = shape.heads, shape.seq, shape.hidden, 2
    plain = dataclasses.replace(shape, attention_dropout=0.0, hidden_dropout=0.0)
    base = plain.layer_activation_bytes(b, 1, 1, 2, unfused=False)
    per_score = {("cuda", 2): 4 + 2 + 1, ("cpu", 2): 4 + 2 + 2, ("cpu", 4): 4 + 4 + 4}
    for (device, e), width in per_score.items():
        t = Training("bf16" if e == 2 else "fp32", 8, device=device)
        assert t.mask_bytes == (1 if device == "cuda" else e)
        got = shape.layer_activation_bytes(b, 1, 1, e, t.mask_bytes)
        flash = plain.layer_activation_bytes(b, 1, 1, e, unfused=False)
        assert got - flash == pytest.approx(b * s * (a * s * width + 2 * h * t.mask_bytes))
    assert plain.layer_activation_bytes(b, 1, 1, 2) - base == b * s * a * s * (4 + 2)
    assert plain.layer_activation_bytes(b, 1, 1, 4) - plain.layer_activation_bytes(
        b, 1, 1, 4, unfused=False) == b * s * a * s * 4  # the probabilities are the output

    t = Training("bf16", global_batch=2, streaming=False)  # one micro-batch of 2
    scores_grad = b * a * s * s * (2 + 4 + 4)
    plain_parts = estimate(shape, Layout(micro_batch=2), t).parts
    # BF16_Optimizer's fp32 buffers are there from the start; DeepSpeed's ZeRO optimizer
    # makes its gradients in the first backward: none yet at its start
    assert plain_parts["gradients"] == 4 * shape.parameters()
    assert estimate(shape, Layout(micro_batch=2, zero_stage=2), t).parts["gradients"] == 0
    logits = shape.logits_bytes(2, 1, 1)
    assert (logits >= scores_grad) == ("logits" in plain_parts)
    recompute = estimate(shape, Layout(micro_batch=2, recompute="full"), t).parts
    one = shape.layer_activation_bytes(2, 1, 1, 2)
    assert recompute["recomputed layer"] == pytest.approx(one + scores_grad)
    # selective: each layer keeps no scores (only a flash kernel's share of it), and one
    # layer's are held again while their backward runs
    selective = estimate(shape, Layout(micro_batch=2, recompute="selective"),
                         dataclasses.replace(t, global_batch=4)).parts
    kept = one - b * s * a * s * (4 + 2 + 1)
    assert shape.layer_activation_bytes(2, 1, 1, 2, selective=True) == pytest.approx(kept)
    assert selective["activations"] == pytest.approx(shape.layers * kept)
    assert selective["attention backward"] == pytest.approx(one - kept + scores_grad)
    flash = estimate(shape, Layout(micro_batch=2), dataclasses.replace(t, attention="flash"))
    assert flash.parts["activations"] == pytest.approx(
        shape.layers * plain.layer_activation_bytes(2, 1, 1, 2, unfused=False)
        + shape.layers * 2 * s * 2 * h * 1)  # the dropout masks stay
    accumulating = estimate(shape, Layout(micro_batch=1), t).parts  # two micro-batches
    assert accumulating["gradients"] == pytest.approx(4 * shape.parameters())


@pytest.mark.parametrize("flags, kernel", [
    ([], "flash"), (["--attention-backend", "fused"], "flash"), (["--use-flash-attn"], "flash"),
    (["--ladder-residual"], "flash"), (["--attention-backend", "unfused"], "unfused"),
    (["--attention-backend", "local"], "unfused")])
def test_plan_takes_the_attention_the_flags_run(flags, kernel):
    """``auto`` runs torch's fused attention on the local layers (Ladder's too): no scores."""
    from megatron_streaming.plan.__main__ import attention_kernel

    assert attention_kernel(parse_args([*MODEL, *flags])) == kernel


def test_step_time_counts_the_unfused_attention_and_the_optimizers_host_time():
    """The local attention's scores cost SCORE_BYTES each at the memory's speed (a
    recompute, full or selective, adds the forward's share; flash none, under Ulysses too,
    which wraps the same core attention);
    the fused optimizer path takes the longer of its bytes and HOST_SECONDS_PER_TENSOR per
    parameter tensor (292 in this 24-layer GPT, as DeepSpeed's per-tensor checks ran on the
    H200; 6 a layer and 3 more for a Llama without biases)."""
    from megatron_streaming.plan.step_time import (HOST_SECONDS_PER_TENSOR, SCORE_BYTES,
                                                   SCORE_BYTES_FORWARD, Fabric, optimizer_bytes,
                                                   step_time)

    shape = ModelShape.from_config(parse_args(MODEL).model, 32000)
    assert shape.stage_tensors(1, 0) == 292
    llama = ModelShape.from_config(parse_args([*MODEL, "--swiglu", "--normalization", "RMSNorm",
                                               "--position-embedding-type", "rope",
                                               "--disable-bias-linear",
                                               "--untie-embeddings-and-output-weights"]
                                              ).model, 32000)
    assert llama.stage_tensors(1, 0) == 24 * 6 + 3
    assert shape.stage_tensors(2, 0) + shape.stage_tensors(2, 1) == 292 + 1  # tied copy
    t = Training("bf16", global_batch=8, streaming=False)
    fabric = Fabric(1e15, 1e11, 1e10, 8, memory_bytes_per_s=1e12)
    scores = 2 * shape.heads * shape.seq ** 2 * 4 * shape.layers  # mb 2, 4 micro-batches
    plain = step_time(shape, Layout(micro_batch=2), t, fabric)
    assert plain["attention scores"] == pytest.approx(scores * SCORE_BYTES / 1e12)
    recompute = step_time(shape, Layout(micro_batch=2, recompute="full"), t, fabric)
    assert recompute["attention scores"] == pytest.approx(
        scores * (SCORE_BYTES + SCORE_BYTES_FORWARD) / 1e12)
    # selective: the scores' forward again too, and of the FLOPs only the attention's
    # two products (4 s x heads x channels a token a layer), not the whole forward
    selective = step_time(shape, Layout(micro_batch=2, recompute="selective"), t, fabric)
    assert selective["attention scores"] == pytest.approx(recompute["attention scores"])
    again = 4 * shape.seq * shape.heads * shape.kv_channels * shape.layers * 8 * shape.seq
    assert selective["compute"] - plain["compute"] == pytest.approx(again / 1e15)
    assert plain["compute"] < selective["compute"] < recompute["compute"]
    # a calibration that holds the first passes (the CPU's): only a recompute's second
    # forward of the scores is priced, at its own measured cost
    calibrated = dataclasses.replace(fabric, score_bytes=0.0, score_bytes_again=120.0)
    assert "attention scores" not in step_time(shape, Layout(micro_batch=2), t, calibrated)
    for kind in ("selective", "full"):
        again_only = step_time(shape, Layout(micro_batch=2, recompute=kind), t, calibrated)
        assert again_only["attention scores"] == pytest.approx(scores * 120.0 / 1e12)
    flash = dataclasses.replace(t, attention="flash")
    assert "attention scores" not in step_time(shape, Layout(micro_batch=2), flash, fabric)
    assert "attention scores" not in step_time(shape, Layout(sp=2, micro_batch=2), flash,
                                               fabric)
    assert "attention scores" in step_time(shape, Layout(sp=2, micro_batch=2), t, fabric)
    moved = optimizer_bytes(shape, Layout(micro_batch=2), t)
    assert plain["optimizer"] == pytest.approx(max(moved / 1e12, 292 * HOST_SECONDS_PER_TENSOR))
    cpu = dataclasses.replace(fabric, fused_optimizer=False)
    assert step_time(shape, Layout(micro_batch=2), t, cpu)["optimizer"] == pytest.approx(
        optimizer_bytes(shape, Layout(micro_batch=2), t, fused=False) / 1e12)


def test_plan_prints_sbatch_lines_that_pretrain_gpt_accepts(capsys):
    assert main([*CLUSTERS, "--rendezvous", "login01.example:29500", *MODEL,
                 "--explain"]) == 0
    out = capsys.readouterr().out
    assert "Sync over the link (10 Gbit/s, RTT 80 ms): --diloco-inner-steps" in out
    assert "bash launch/rendezvous.sh --port 29500" in out
    assert "Candidates on h100-east" in out and "chosen" in out
    # 64 H100s and 32 A100s: a worker of each whole cluster (none idle); three workers of 32
    # would step no faster and cost the loss of a third worker.
    assert "Plan: 2 workers of 64 / 32 devices (1 on h100-east, 1 on a100-west)" in out
    assert "devices idle" not in out
    assert "  1 + 1 workers of 64 / 32 devices: slowest step" in out  # --explain: the cuts
    assert "  2 + 1 workers of 32 devices: slowest step" in out
    lines = [shlex.split(line) for line in out.splitlines() if line.startswith("sbatch ")]
    assert len(lines) == 2
    batches = []
    for worker, (line, devices) in enumerate(zip(lines, (64, 32))):
        nodes = int(next(a for a in line if a.startswith("--nodes=")).split("=")[1])
        gpus = int(next(a for a in line if a.startswith("--gpus-per-node=")).split("=")[1])
        assert nodes * gpus == devices
        args = line[line.index("launch/slurm.sh") + 1:]
        cfg = parse_args(args)
        validate(cfg, nodes * gpus * 2)  # the job as this launch first numbers it
        assert cfg.streaming.diloco_worker_index == worker and cfg.streaming.diloco_workers == 2
        assert cfg.parallel.rendezvous_external and cfg.parallel.master_addr == "login01.example"
        batches.append(cfg.training.global_batch_size)
    # The job's 512 shared by speed: the H100 worker takes the larger part, and the
    # predicted steps of the two workers take about as long.
    assert sum(batches) == 512 and batches[0] > 4 * batches[1], batches
    steps = [float(m) for m in re.findall(r"GiB per device, ([0-9.]+) s per step", out)]
    assert len(steps) == 2 and max(steps) / min(steps) < 1.05, steps


def test_clusters_are_cut_into_workers():
    from megatron_streaming.plan.clusters import Cluster
    from megatron_streaming.plan.search import sizes

    def cluster(nodes):
        return Cluster(f"c{nodes}", nodes, 8, 80, 989, 450, 50)

    def cuts(*nodes, most=8):
        return [(o.ranks, o.counts) for o in sizes([cluster(n) for n in nodes], most)]

    # one worker per whole cluster, then workers of one size
    assert cuts(8, 4) == [([64, 32], [1, 1]), ([32, 32], [2, 1]), ([16, 16], [4, 2])]
    assert cuts(6, 4) == [([48, 32], [1, 1]), ([32, 32], [1, 1]), ([16, 16], [3, 2])]
    assert cuts(6, 4, most=2) == [([48, 32], [1, 1]), ([32, 32], [1, 1])]
    assert cuts(1, 1) == [([8, 8], [1, 1]), ([4, 4], [2, 2]), ([2, 2], [4, 4])]


def test_plan_errors_name_the_file_and_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: 2\ndevices_per_node: 8\nflops: 3\n")
    assert main(["--cluster", str(bad), "--link", "launch/clusters/link_10g_80ms.yaml",
                 *MODEL]) == 2
    assert f"plan: error: {bad}: unknown field(s) flops (known: " in capsys.readouterr().err
    small = tmp_path / "small.yaml"
    small.write_text("nodes: 1\ndevices_per_node: 1\ndevice_memory_gib: 8\npeak_tflops: 100\n"
                     "intra_node_gb_per_s: 100\ninter_node_gb_per_s: 10\n")
    assert main(["--cluster", str(small), "--cluster", str(small), "--link",
                 "launch/clusters/link_10g_80ms.yaml", *MODEL]) == 2
    assert "no layout of the model fits small (1 devices, batch 256)" in \
        capsys.readouterr().err


def test_step_time_counts_every_collective_and_its_bytes():
    """Per layer and micro-batch: TP four all-reduces (six under a full recompute), Ulysses
    query, key, value and context in and their gradients out (eight, twelve), PP a send and a
    receive per boundary each way, data parallel DeepSpeed's all-reduce of the gradient
    buckets (two ring phases) and under ZeRO-1/2 the all-gather of the updated weights, at
    the all-gather's own speed; each costs the fabric's latency on top of its bytes. GQA (4
    of 16 heads' keys and values) to check that Ulysses moves key and value at the query
    groups' width."""
    from megatron_streaming.plan.step_time import Fabric, step_time

    cfg = parse_args([*MODEL, "--group-query-attention", "--num-query-groups", "4"])
    shape = ModelShape.from_config(cfg.model, 32000)
    t = Training("bf16", global_batch=16)

    def seconds(latency, bandwidth, gather_speed=1.0, **kw):
        fabric = Fabric(1e15, bandwidth, bandwidth, 8, 0.0, latency, gather_speed=gather_speed)
        return step_time(shape, Layout(**kw), t, fabric)

    layers = shape.layers
    for kw, term, count in [
            (dict(tp=2, micro_batch=2), "tensor parallel", 4 * layers * 8),
            (dict(tp=2, micro_batch=2, recompute="full"), "tensor parallel", 6 * layers * 8),
            (dict(sp=2, micro_batch=2), "sequence parallel", 8 * layers * 8),
            (dict(sp=2, micro_batch=2, recompute="full"), "sequence parallel", 12 * layers * 8),
            # a selective recompute runs the core attention again, Ulysses' all-to-alls in it
            (dict(sp=2, micro_batch=2, recompute="selective"), "sequence parallel",
             12 * layers * 8),
            (dict(tp=2, micro_batch=2, recompute="selective"), "tensor parallel", 4 * layers * 8),
            (dict(pp=2, micro_batch=2), "pipeline", 2 * 8),
            (dict(pp=4, micro_batch=2), "pipeline", 4 * 8),
            (dict(dp=2, micro_batch=2, zero_stage=0), "data parallel", 2),
            (dict(dp=2, micro_batch=2, zero_stage=1), "data parallel", 3)]:
        with_latency, without = seconds(1e-3, 1e30, **kw), seconds(0.0, 1e30, **kw)
        assert with_latency[term] - without[term] == pytest.approx(count * 1e-3), (kw, term)
    # Bytes at 1 B/s, no latency: Ulysses' eight all-to-alls per layer and micro-batch send
    # half of (2 x 16 query/context heads + 2 x 4 key/value groups) x 128 channels per token.
    kv = shape.kv_channels
    tokens = 2 * shape.seq / 2  # micro-batch 2, half the sequence per rank
    sent = 2 * layers * 8 * 0.5 * tokens * (2 * 16 + 2 * 4) * kv * 2
    assert seconds(0.0, 1.0, sp=2, micro_batch=2)["sequence parallel"] == pytest.approx(sent)
    # Data parallel over 4 ranks at 1 B/s: the fp32 gradients' ring all-reduce (2 x 3/4 of
    # them), then 3/4 of the bf16 weights gathered at a third of that speed (gloo's).
    from megatron_streaming.plan.memory import estimate_stage

    zero2 = dict(dp=4, micro_batch=2, zero_stage=2)
    params = estimate_stage(shape, Layout(**zero2), t, 0.0, 0).parts["weights"] / t.weight_bytes
    assert seconds(0.0, 1.0, 1 / 3, **zero2)["data parallel"] == pytest.approx(
        2 * 0.75 * 4 * params + 0.75 * 2 * params * 3)
    activation = 2 * shape.seq * shape.hidden * 2
    assert seconds(0.0, 1.0, tp=2, micro_batch=2)["tensor parallel"] == \
        pytest.approx(4 * layers * 8 * activation)  # ring 2 (t - 1) / t = 1 at t = 2


def test_optimizer_bytes_follow_the_code_path_of_each_layout():
    """Fused AdamW moves 28 bytes an element, torch's single-tensor path 80; DeepSpeed's
    ZeRO-1/2 adds 28 per partition element and 20 per element of the rank's gradient; ZeRO-0
    in fp32 steps the module in place after a bucketed all-reduce (16, with data-parallel
    ranks only)."""
    from megatron_streaming.plan.step_time import optimizer_bytes

    shape = ModelShape.from_config(parse_args(MODEL).model, 32000)
    fp32, bf16 = Training("fp32", global_batch=16), Training("bf16", global_batch=16)
    n = shape.stage_parameters(1, 1, 0)
    assert optimizer_bytes(shape, Layout(dp=1, zero_stage=0), fp32) == pytest.approx(28 * n)
    assert optimizer_bytes(shape, Layout(dp=2, zero_stage=0), fp32, fused=False) == \
        pytest.approx((80 + 16) * n)
    for stage in (1, 2):
        assert optimizer_bytes(shape, Layout(dp=4, zero_stage=stage), bf16) == \
            pytest.approx((28 + 28) * n / 4 + 20 * n)
    assert optimizer_bytes(shape, Layout(dp=2, zero_stage=0), bf16, fused=False) == \
        pytest.approx((80 + 28 + 20) * n)  # 16-bit without ZeRO: DeepSpeed's flat copy
    half = shape.stage_parameters(1, 2, 0)  # the first of two stages
    assert optimizer_bytes(shape, Layout(pp=2, dp=2, zero_stage=1), bf16) == \
        pytest.approx(56 * half / 2 + 20 * half)


def test_a_cut_into_more_workers_must_be_faster_by_a_share_per_worker():
    from megatron_streaming.plan import search
    from megatron_streaming.plan.search import Option

    def option(ranks, counts, seconds):
        return dataclasses.replace(Option(ranks, counts), step_seconds=seconds)

    whole, three, six = option([64, 32], [1, 1], 0.38), option([32, 32], [2, 1], 0.37), \
        option([16, 16], [4, 2], 0.30)
    assert search.pick([whole, three, six]) is six  # 0.30 x 1.05^4 = 0.365 < 0.38
    six = option([16, 16], [4, 2], 0.32)  # 0.389
    assert search.pick([whole, three, six]) is whole  # three: 0.37 x 1.05 = 0.3885
    three = option([32, 32], [2, 1], 0.36)  # 0.378
    assert search.pick([whole, three, six]) is three


def test_link_model_stalls_only_for_what_the_overlap_does_not_cover():
    from megatron_streaming.plan.search import exchange_seconds, link_utilisation

    # 1M parameters, FP4, 2 workers, P=4 at 10 Gbit/s and 100 ms: bytes are nothing, the two
    # round trips are 0.2 s, with a window that stayed open.
    ex = exchange_seconds(1e6, 4.25, 2, 4, 10, 100, slow_start_after_idle=False)
    assert ex == pytest.approx(1e6 / 4 * 4.25 / 10e9 + 0.2)
    # From TCP's initial window (14,480 bytes) each collective's 66,406 bytes take two more
    # round trips (14,480 + 28,960 sent, then the rest fits), the all-gather one more (57,920
    # is still short of its 66,406): three; the 101,360 bytes those rounds carry travel
    # within them.
    assert exchange_seconds(1e6, 4.25, 2, 4, 10, 100) == pytest.approx(
        ex + 0.3 - 101_360 / 1.25e9)
    # Over 8 connections each carries 8,301 bytes a collective: no extra round trip.
    assert exchange_seconds(1e6, 4.25, 2, 4, 10, 100, connections=8) == pytest.approx(ex)
    # A short link: the window soon holds the bandwidth-delay product (1.25 MB at 1 ms).
    assert exchange_seconds(1e9, 4.25, 2, 1, 10, 1) == pytest.approx(
        1e9 * 4.25 / 10e9 + 0.002 + 7 * 0.001  # 14,480 x 2^7 > 1.25e6
        - 14_480 * (2 ** 7 - 1) / 1.25e9)  # the all-gather starts past the cap
    assert link_utilisation(0.5, ex, 40, 4, 1) == 1.0  # tau=1 covers 0.5 s
    # 0.1 s steps: tau=1 leaves ex - 0.1 s per exchange, one exchange every 10 steps.
    assert link_utilisation(0.1, ex, 40, 4, 1) == pytest.approx(0.1 / (0.1 + (ex - 0.1) / 10))
    # the sync's own work per exchange adds to it, covered or not
    assert link_utilisation(0.1, ex, 40, 4, 1, sync_seconds=0.05) == pytest.approx(
        0.1 / (0.1 + (ex - 0.1 + 0.05) / 10))
    assert link_utilisation(0.1, 0.01, 40, 4, 1, sync_seconds=0.05) == pytest.approx(
        0.1 / (0.1 + 0.05 / 10))
    assert link_utilisation(0.1, ex, 40, 4, 0, eager=True) == 1.0  # a round covers it


def test_the_window_an_exchange_starts_with_follows_linux_restart_after_idle():
    from megatron_streaming.plan.search import (INITIAL_WINDOW_BYTES, exchange_seconds,
                                                restarted_window, slow_start,
                                                steady_exchange_seconds)

    # slow start: round trips, the bytes they carry, the window after (grown by what was
    # acknowledged while the window limited the sending: at most twice the largest flight)
    assert slow_start(66_406, 1e9, 14_480) == (2, 43_440, 57_920)
    assert slow_start(66_406, 1e9, 57_920) == (1, 57_920, 115_840)
    assert slow_start(66_406, 1e9, 115_840) == (0, 0.0, 132_812)
    # the cap (the bandwidth-delay product) stops the doubling; the window still grows with
    # what a full link acknowledges
    assert slow_start(66_406, 20_000, 14_480) == (1, 14_480, 57_920)
    # tcp_cwnd_restart: kept under one timeout; halved per timeout past the first, down to
    # the initial window
    assert restarted_window(100_000, 0.25, 0.3) == 100_000
    assert restarted_window(100_000, 0.7, 0.3) == 25_000
    assert restarted_window(100_000, 5.0, 0.3) == INITIAL_WINDOW_BYTES
    assert restarted_window(10_000, 5.0, 0.3) == 10_000  # never raised to the initial one
    link = dict(parameters=1e6, bits=4.25, workers=2, fragments=4, gbit_per_s=10, rtt_ms=100)
    open_window = exchange_seconds(**link, slow_start_after_idle=False)
    from_initial = exchange_seconds(**link)
    # timeout: 100 ms + the 66,406-byte burst's queueing (53 us) + 200 ms
    assert exchange_seconds(**link, idle_seconds=0.25) == pytest.approx(open_window)
    assert exchange_seconds(**link, idle_seconds=5.0) == from_initial
    # 0.7 s: two halvings of the 132,812 bytes the last exchange left: 33,203, one round trip
    assert exchange_seconds(**link, idle_seconds=0.7) == pytest.approx(
        open_window + 0.1 - 33_203.125 / 1.25e9)
    # 0.1 s steps, an exchange every 10 (H=40, P=4) that tau=1 covers 0.1 s of: the gap is the
    # other 9 steps
    assert steady_exchange_seconds(0.1, 40, 1, False, **link) == pytest.approx(
        exchange_seconds(**link, idle_seconds=0.7))
    # blocking (P=1, tau=0): the gap is H steps, long enough to start from the initial window
    assert steady_exchange_seconds(0.1, 40, 0, False, **{**link, "fragments": 1}) == \
        exchange_seconds(**{**link, "fragments": 1})


MOE = ["--num-experts", "16", "--moe-router-topk", "2", "--disable-bias-linear", "--swiglu",
       "--normalization", "RMSNorm", "--position-embedding-type", "rope"]


def test_mixture_of_experts_prices_experts_by_ep_and_the_plan_searches_it(capsys):
    """An MoE model: its parameters are the door's and add up over stages; EP divides the
    routed experts' weights and gradients (the optimizer partition stays the data x sequence
    ranks'), adds the dispatcher's all-to-alls to the step, and the plan for the example
    clusters chooses an EP its launch accepts, the exchange counting every expert."""
    cfg = parse_args([*MODEL, *MOE])
    shape = ModelShape.from_config(cfg.model, 32000)
    assert shape.parameters() == parameter_count(cfg.model, 32000)
    assert sum(shape.stage_parameters(1, 2, s) for s in range(2)) == pytest.approx(
        shape.parameters() + shape.vocab * shape.hidden * shape.tied)
    training = Training(precision="bf16", global_batch=64)
    one, eight = (estimate(shape, Layout(dp=8, ep=ep, zero_stage=1), training) for ep in (1, 8))
    routed = shape.stage_routed(1, 1)
    assert one.parts["weights"] - eight.parts["weights"] == pytest.approx(routed * 7 / 8 * 2)
    assert one.parts["optimizer"] == eight.parts["optimizer"]
    from megatron_streaming.plan.step_time import Fabric, step_time

    fabric = Fabric(4e14, 4e11, 5e10, 8)
    assert "expert parallel" not in step_time(shape, Layout(dp=8), training, fabric)
    assert step_time(shape, Layout(dp=8, ep=8), training, fabric)["expert parallel"] > 0
    assert main([*CLUSTERS, "--rendezvous", "login01.example:29500", *MODEL, *MOE]) == 0
    out = capsys.readouterr().out
    lines = [shlex.split(line) for line in out.splitlines() if line.startswith("sbatch ")]
    eps = []
    for line in lines:
        nodes = int(next(a for a in line if a.startswith("--nodes=")).split("=")[1])
        gpus = int(next(a for a in line if a.startswith("--gpus-per-node=")).split("=")[1])
        launched = parse_args(line[line.index("launch/slurm.sh") + 1:])
        validate(launched, nodes * gpus * len(lines))
        eps.append(launched.parallel.expert_model_parallel_size)
    # 13.3B parameters: the H100 worker spreads its experts over eight ranks
    assert "13,303.6M parameters" in out and eps[0] == 8, eps


@pytest.mark.parametrize("flags, stage, width, whole", [
    (["--bf16"], 0, 2, False), (["--bf16"], 1, 4, True), (["--bf16"], 2, 4, False),
    (["--bf16", "--grad-reduce-in-bf16"], 1, 2, False),
    (["--bf16", "--grad-reduce-in-bf16"], 2, 2, False),
    (["--fp16"], 1, 2, False), ([], 1, 4, False)])
def test_gradients_take_the_width_deepspeed_accumulates_them_in(flags, stage, width, whole):
    """The planner's gradient element is the ``grad_accum_dtype`` the generated DeepSpeed
    config asks for: fp32 for bf16 under ZeRO (Megatron-LM's accumulation), bf16 at ZeRO-0
    and with --grad-reduce-in-bf16, fp16 for fp16. bf16 at ZeRO-1 (BF16_Optimizer) keeps
    whole fp32 buffers from the start, and its step's all-reduce flattens them into one more
    fp32 copy while they fit one bucket."""
    from megatron_streaming.config.ds_config import precision_sections
    from megatron_streaming.plan.memory import fp32_buffers_whole, gradient_bytes

    cfg = parse_args(["--mock-data", "--num-layers", "2", "--hidden-size", "64",
                      "--num-attention-heads", "4", "--seq-length", "32", *flags])
    generated = precision_sections(cfg.precision, stage).get("data_types", {})
    assert {"fp32": 4, "bf16": 2, "fp16": 2}[generated.get("grad_accum_dtype", "fp32")] == width
    precision = cfg.precision.dtype_name
    t = Training(precision, global_batch=2, streaming=False, device="cpu",
                 grad_reduce_in_bf16=cfg.precision.grad_reduce_in_bf16)
    layout = Layout(dp=2, zero_stage=stage)  # one micro-batch a step
    assert gradient_bytes(layout, t) == width and fp32_buffers_whole(layout, t) == whole
    shape = ModelShape.from_config(cfg.model, 512)
    params = shape.stage_parameters(1, 1, 0)
    memory = estimate(shape, layout, t).parts
    assert memory["gradients"] == (4 * params if whole else 0)  # at the backward's start
    rest = memory["activations"] + memory.get("logits", memory.get("attention backward", 0))
    if whole:  # the step: buffers, and the larger of the all-reduce's copy and AdamW's
        assert memory["optimizer step"] == pytest.approx(
            4 * params + max(4 * params, 4 * 4 * params / 2) - memory["gradients"] - rest)


def test_host_memory_per_rank_and_node_by_hand():
    """A 2-layer GPT of 134,912 parameters (tied 512 x 64 embedding 32,768, positions 2,048,
    each layer 49,984, the final norm 128) at DP=2, ZeRO-1, bf16, two fragments, tau 1: a
    rank writes half of every parameter, 2 + 4 + 8 bytes of weights, masters and moments and
    8 + 4/2 of theta_g, momentum and the means in flight (24 bytes); offloaded, theta_g and
    the momentum of its half take 8 bytes an element pinned at their size, the exchange's
    working set (13 bytes an element of a fragment's shard) and the deltas in flight (4 of
    the shard) pageable, and the shard's copy out of the GPU torch's power of two. Without
    offload the codes (4.25 bits an element of the fragment's shard) pass through four
    pinned buffers of powers of two each way."""
    from megatron_streaming.plan.memory import host_estimate
    from megatron_streaming.plan.report import host_line
    from megatron_streaming.plan.search import Candidate, WorkerPlan

    cfg = parse_args(["--mock-data", "--num-layers", "2", "--hidden-size", "64",
                      "--num-attention-heads", "4", "--seq-length", "32", "--bf16"])
    shape = ModelShape.from_config(cfg.model, 512)
    n = 32768 + 2048 + 2 * 49984 + 128
    assert shape.parameters() == n == 134912
    layout = Layout(dp=2, zero_stage=1)
    t = Training("bf16", 8, fragments=2, overlap_steps=1, save=True, async_save=True,
                 offload_outer_state=True)
    host = host_estimate(shape, layout, t)
    assert host.parts == {"checkpoint staging": 12 * n,
                          "outer state": 4 * n + 13 * n / 4 + n + 2 ** 18}
    assert host.pinned == 12 * n + 4 * n + 2 ** 18  # 2 ** 18 = 262,144 >= 4 x n / 4
    codes = host_estimate(shape, layout, dataclasses.replace(t, offload_outer_state=False))
    assert codes.parts["exchange codes"] == 2 * 32768 + 3 * 16384  # 17,914 and 8,957 bytes
    assert codes.pinned == 12 * n + 2 * 32768 + 3 * 16384
    synchronous = host_estimate(shape, layout, dataclasses.replace(t, async_save=False))
    assert synchronous.parts["checkpoint being saved"] == 12 * n
    assert synchronous.pinned == 4 * n + 2 ** 18
    cpu = host_estimate(shape, layout, dataclasses.replace(t, device="cpu"))
    assert cpu.pinned == 0 and cpu.parts["checkpoint staging"] == 12 * n

    # The line: a node's 8 ranks of a worker of 16, each 3 GiB staged and 1.5 GiB of outer
    # state, 4 GiB of it pinned; against the node's host memory where the cluster gives it.
    from megatron_streaming.plan.clusters import Cluster
    from megatron_streaming.plan.memory import GIB, HostMemory

    cluster = Cluster("c", 2, 8, 80, 100, 1, 1, host_memory_gib=64)
    rank = HostMemory({"checkpoint staging": 3 * GIB, "outer state": 1.5 * GIB}, 4 * GIB)
    w = WorkerPlan(cluster, Candidate(Layout(dp=16), 1.0, 1.0, 1.0), 8, 1.0, host=rank)
    assert host_line(w) == ("host memory per node: 36.0 GiB, 32.0 of it pinned (8 ranks: "
                            "checkpoint staging 24.0, outer state 12.0 GiB); fits the node's "
                            "64 GiB")
    small = dataclasses.replace(w, cluster=dataclasses.replace(cluster, host_memory_gib=32))
    assert host_line(small).endswith("more than the node's 32 GiB: --async-save or "
                                     "--diloco-offload-outer-state off, or fewer ranks per "
                                     "node")


def test_a_one_worker_plan_launches_plain_training_without_sync_flags(capsys):
    """One cluster as one worker: no link to plan for, and sync flags would turn on one
    worker's outer optimizer, which is opt-in: the launch line holds none of them."""
    assert main(["--cluster", "launch/clusters/h200_8.yaml", "--link",
                 "launch/clusters/link_10g_80ms.yaml", "--rendezvous", "login01.example:29500",
                 *MODEL, "--max-workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "Sync: none (one worker: data parallel inside it, no sync" in out
    assert "Sync over the link" not in out
    line, = [shlex.split(line) for line in out.splitlines() if line.startswith("sbatch ")]
    args = line[line.index("launch/slurm.sh") + 1:]
    assert [a for a in args if a.startswith("--diloco-")] == [
        "--diloco-workers", "--diloco-worker-index"]
    cfg = parse_args(args)
    validate(cfg, 8)
    assert not cfg.streaming.diloco_sync  # plain training: no outer state


SPARSE = ["--diloco-quantize", "sparse"]


def test_the_sparse_wires_bytes_are_the_codecs_and_the_transports_closed_form():
    """``--diloco-quantize sparse`` at its defaults (k 64 of 4,096, 2-bit values): a chunk is
    64 x 12 / 8 = 96 bytes of positions, 16 of values and a 4-byte scale, 116; a shard adds
    its 4-byte flag, and the all-gather sends the row to each of the M-1 others. The dense
    FP4 moves 2 (M-1)/M of 4.25 bits a value."""
    import torch

    from megatron_streaming.comm.sparse_transport import FLAG_BYTES
    from megatron_streaming.plan.wire import DENSE_FP4, Wire

    wire = Wire.from_streaming(parse_args([*MODEL, *SPARSE]).streaming)
    assert (wire.sparse, wire.chunk, wire.k, wire.value_bits, wire.collectives) == \
        (True, 4096, 64, 2, 1)
    assert Wire.from_streaming(parse_args(MODEL).streaming) == DENSE_FP4
    n = 100 * 4096 + 100  # 101 chunks, the last short
    assert wire.bytes_sent(n, 2) == 101 * 116 + 4 == 11_720
    assert wire.bytes_sent(n, 4) == 3 * 11_720  # grows with M-1, unlike the dense ring
    assert wire.bytes_sent(n, 1) == 0
    # two lanes of 204,850: 51 chunks each
    assert wire.bytes_sent(n, 2, lanes=2) == 2 * (51 * 116 + 4) == 11_840
    # what the codec really encodes: payload and scales, plus the transport's flag
    encoded = wire.codec().encode(torch.randn(n, generator=torch.Generator().manual_seed(0)))
    assert encoded.nbytes() + FLAG_BYTES == wire.bytes_sent(n, 2)
    assert DENSE_FP4.bytes_sent(1e6, 2) == 1e6 * 4.25 / 8
    assert DENSE_FP4.bytes_sent(1e6, 4) == pytest.approx(1e6 * 4.25 * 1.5 / 8)
    wide = Wire("sparse", chunk=1024, k=32, value_bits=3)  # 40 + 12 + 4 bytes a chunk
    assert wide.bytes_sent(4096, 3) == 2 * (4 * 56 + 4)


def test_a_sparse_exchange_is_one_collective_of_its_bytes_on_the_link():
    """1M parameters, P=4, 2 workers, 10 Gbit/s, 100 ms: a fragment of 250,000 elements is 62
    chunks, 7,196 bytes with the flag; one all-gather, one round trip, and within TCP's
    initial window (14,480 bytes) no slow-start round, where the dense FP4's two collectives
    of 66,406 bytes take two round trips and three more (test above)."""
    from megatron_streaming.plan.search import exchange_seconds
    from megatron_streaming.plan.wire import Wire

    link = dict(parameters=1e6, workers=2, fragments=4, gbit_per_s=10, rtt_ms=100)
    sparse = exchange_seconds(bits=Wire("sparse"), **link)
    assert sparse == pytest.approx(7_196 / 1.25e9 + 0.1)
    assert exchange_seconds(bits=Wire("sparse"), **link, slow_start_after_idle=False) == sparse
    assert exchange_seconds(bits=4.25, **link) == pytest.approx(
        1e6 / 4 * 4.25 / 10e9 + 0.2 + 0.3 - 101_360 / 1.25e9)
    # 400 MB fragments over 4 workers at 1 ms: 3 x 100,000 chunks of 116 bytes (+ 4) in one
    # collective, from a window past the cap
    big = dict(link, parameters=4 * 409_600_000, workers=4, rtt_ms=1)
    nbytes = 3 * (100_000 * 116 + 4)
    assert exchange_seconds(bits=Wire("sparse"), **big, slow_start_after_idle=False) == \
        pytest.approx(nbytes / 1.25e9 + 0.001)


def test_a_sparse_wire_lets_the_link_take_a_smaller_h():
    """409.6M parameters, 2 workers, 10 ms steps, 1 Gbit/s of which half for the sync (5e6
    bits a step): the dense FP4's 1.7408e9 bits a round need H >= 348.16, so 349, rounded up
    to a multiple of 6, 354; the sparse wire's 100,000 x 116 + 4 bytes (92,800,032 bits)
    need 18.56: 19, so 24. Before the rounding H drops by 4.25 x 4,096 / 928 = 18.76, the
    bits per value of FP4 over the sparse one's."""
    import types

    from megatron_streaming.plan.clusters import Link
    from megatron_streaming.plan.search import _sync
    from megatron_streaming.plan.wire import DENSE_FP4, Wire
    from megatron_streaming.streaming import rule

    params = 409_600_000
    shape = types.SimpleNamespace(parameters=lambda: params, layers=24)
    link = Link(1.0, 10.0, slow_start_after_idle=False)
    dense = _sync(shape, link, 2, 0.01, 10 ** 6, rule, 0.5)
    sparse = _sync(shape, link, 2, 0.01, 10 ** 6, rule, 0.5, wire=Wire("sparse"))
    assert dense[0].inner_steps == 354 and sparse[0].inner_steps == 24
    assert (dense[0].quantize, sparse[0].quantize) == ("fp4-e2m1", "sparse")
    assert sparse[0].flags()[sparse[0].flags().index("--diloco-quantize") + 1] == "sparse"
    assert (dense[0].outer_lr, sparse[0].outer_lr) == (1.0, rule.SPARSE_OUTER_LR)
    dense_bits = 8 * DENSE_FP4.bytes_sent(params, 2)
    sparse_bits = 8 * Wire("sparse").bytes_sent(params, 2)
    assert (dense_bits, sparse_bits) == (params * 4.25, 92_800_032)
    assert dense_bits / sparse_bits == pytest.approx(4.25 * 4096 / 928)
    # mean link rates: a round's bits over H steps
    assert dense[4] == pytest.approx(dense_bits / (354 * 0.01) / 1e9)
    assert sparse[4] == pytest.approx(sparse_bits / (24 * 0.01) / 1e9)  # 0.387 Gbit/s
    assert sparse[4] == pytest.approx(0.38667, rel=1e-4)
    # the wire is a default: no wire given is the dense FP4
    assert _sync(shape, link, 2, 0.01, 10 ** 6, rule, 0.5, wire=DENSE_FP4)[:1] == dense[:1]


def test_a_sparse_plan_keeps_its_flag_and_counts_its_bytes(capsys):
    """The example clusters with ``--diloco-quantize sparse``: the plan keeps the flag (which
    it otherwise sets to fp4-e2m1), passes ``--diloco-sparse-*`` through, and its ratio to
    data parallel is H x the bf16 gradients over the sparse bytes of the whole model over the
    32 lanes of the smaller worker."""
    from megatron_streaming.plan.wire import Wire

    assert main([*CLUSTERS, *MODEL, *SPARSE, "--diloco-sparse-k", "32"]) == 0
    out = capsys.readouterr().out
    sync = next(line for line in out.splitlines() if line.startswith("Sync over the link"))
    assert "--diloco-quantize sparse" in sync and "--diloco-inner-steps 6" in sync
    params = ModelShape.from_config(parse_args(MODEL).model, 32000).parameters()
    wire = Wire("sparse", k=32)  # a chunk: 48 + 8 + 4 bytes
    assert wire.bytes_sent(4096, 2) == 64
    fewer = 6 * params * 16 / 8 / wire.bytes_sent(params, 2, lanes=32)
    assert f"; {fewer:.0f}x fewer bytes than data parallel" in out
    assert "exchange payloads" in out and "exchange codes" not in out
    for line in (shlex.split(line) for line in out.splitlines() if line.startswith("sbatch ")):
        cfg = parse_args(line[line.index("launch/slurm.sh") + 1:])
        assert (cfg.streaming.diloco_quantize, cfg.streaming.diloco_sparse_k) == ("sparse", 32)


def test_host_memory_of_the_sparse_exchange_by_hand():
    """The 2-layer GPT of the test above at DP=2, two fragments: a fragment's shard of 33,728
    elements is 9 chunks, a row of 9 x 116 + 4 = 1,048 bytes, pinned at 2,048 (torch's power
    of two) once to send and once per worker gathered: 3 x 2,048 with two workers, 5 x with
    four."""
    from megatron_streaming.plan.memory import host_estimate
    from megatron_streaming.plan.wire import Wire

    cfg = parse_args(["--mock-data", "--num-layers", "2", "--hidden-size", "64",
                      "--num-attention-heads", "4", "--seq-length", "32", "--bf16"])
    shape = ModelShape.from_config(cfg.model, 512)
    t = Training("bf16", 8, fragments=2, overlap_steps=1, wire=Wire("sparse"))
    assert Wire("sparse").bytes_sent(134_912 / 4, 2) == 1_048
    host = host_estimate(shape, Layout(dp=2, zero_stage=1), t)
    assert host.parts == {"exchange payloads": 3 * 2048} and host.pinned == 3 * 2048
    four = host_estimate(shape, Layout(dp=2, zero_stage=1), dataclasses.replace(t, workers=4))
    assert four.parts == {"exchange payloads": 5 * 2048}
