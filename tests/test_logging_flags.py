"""Megatron's logging flags that read the optimizer or write beside the checkpoints:
--log-num-zeros-in-grad (``num-zeros``), Megatron-DeepSpeed's
--log-optimizer-states-to-tensorboard (``optimizer/...``), --tensorboard-queue-size and
--log-progress (``progress.txt``).

One launch (two data-parallel ranks under ZeRO-1, so that each holds half of every
gradient and of the Adam state) is shared by the tests that read a run; its references are
independent of the code under test: the gradient's zeros are the position-embedding rows no
sample reaches (--max-position-embeddings past --seq-length), the optimizer's norms are
computed from the whole-model Adam state its last checkpoint stores, the operations from
Megatron-LM's formula.
"""

import json
import re
from datetime import datetime, timedelta
from types import SimpleNamespace

import pytest
import torch

from harness import TINY, run
from test_monitoring import json_lines, scalars  # a run directory's tb/ and log.jsonl

ITERS, SAVE_INTERVAL, SEQ, HIDDEN = 4, 2, 32, 64
# Position rows 32..4095 get no gradient: 260,096 zeros. ZeRO-1 cuts the weights' flat buffer
# (word embedding 256 x 64, position embedding 4096 x 64, then the layers' 196,608) in two at
# element 237,568, inside the position table: each rank steps on zeros of its own.
MAX_POSITIONS = 4096
STEPS = list(range(1, ITERS + 1))
# No linear biases: the key bias's gradient is zero in exact arithmetic (a softmax does not
# see a shift common to all keys), and now and then in floating point too.
MODEL = ["--max-position-embeddings", str(MAX_POSITIONS), "--disable-bias-linear"]
FLAGS = ["--log-num-zeros-in-grad", "--log-optimizer-states-to-tensorboard", "--log-progress",
         "--tensorboard-queue-size", "3"]
MOMENTS = ("variance", "variance_sqrt", "momentum", "weight")
OPTIMIZER_TAGS = [f"optimizer/{m}_{kind}" for m in MOMENTS for kind in ("l2", "l1", "abs_max")]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("logging_flags")
    proc = run(2, [*TINY, *MODEL, "--diloco-workers", "1", "--train-iters", str(ITERS),
                   "--save", str(root / "ckpt"),
                   "--save-interval", str(SAVE_INTERVAL), "--tensorboard-dir", str(root / "tb"),
                   "--log-jsonl", str(root / "log.jsonl"),
                   "--summary-json", str(root / "summary.json"), *FLAGS], timeout=420)
    (root / "output.txt").write_text(proc.stdout + proc.stderr)
    return root, proc.stdout + proc.stderr, json.loads((root / "summary.json").read_text())


@pytest.mark.timeout(600)
def test_num_zeros_counts_the_whole_gradient_once(launched):
    """Each rank steps on half of the gradient (ZeRO-1); the count is over the whole model's:
    exactly the (4096 - 32) x 64 elements of the position rows no sample reaches, at every
    point, against the steps and the samples, and in each progress line."""
    root, output, summary = launched
    expected = (MAX_POSITIONS - SEQ) * HIDDEN
    tags = scalars(root)
    assert tags["num-zeros"] == [(s, expected) for s in STEPS]
    per_step = summary["samples"] // ITERS
    assert tags["num-zeros vs samples"] == [(s * per_step, expected) for s in STEPS]
    assert [line["num-zeros"] for line in json_lines(root) if "num-zeros" in line] == \
        [expected] * ITERS
    assert len(re.findall(rf"iteration .* \| num zeros {expected}\b", output)) == ITERS


def _reference_states(save_dir) -> dict:
    """Megatron-DeepSpeed's optimizer norms over the whole model's Adam state and fp32
    weights, as the checkpoint stores them (each parameter whole, once)."""
    import os

    from megatron_streaming.checkpoint import keys
    from megatron_streaming.checkpoint.offline import open_checkpoint, read_tensors
    from megatron_streaming.checkpoint.store import worker_part

    directory, meta = open_checkpoint(str(save_dir))
    weights = keys.worker(0, keys.MASTER)  # the fp32 masters, where they are not the weights
    if weights not in meta["kinds"]["prefixes"]:
        weights = keys.worker(0, keys.MODEL)
    prefixes = {"variance": keys.optimizer(0, "exp_avg_sq"),
                "momentum": keys.optimizer(0, "exp_avg"), "weight": weights}
    names = list(meta["params"])
    stored = read_tensors(os.path.join(directory, worker_part(meta, 0)),
                          [keys.tensor(p, n) for p in prefixes.values() for n in names])
    whole = {m: torch.cat([stored[keys.tensor(p, n)].double().reshape(-1) for n in names])
             for m, p in prefixes.items()}
    whole["variance_sqrt"] = whole["variance"].sqrt()
    out = {}
    for m in MOMENTS:
        out[f"optimizer/{m}_l2"] = float(whole[m].norm())
        out[f"optimizer/{m}_l1"] = float(whole[m].abs().sum())
        out[f"optimizer/{m}_abs_max"] = float(whole[m].abs().max())
    return out


@pytest.mark.timeout(600)
def test_optimizer_states_are_the_whole_models_adam_state(launched):
    """At the last iteration (which the last checkpoint holds): every ``optimizer/...`` norm
    equals the one computed from the checkpoint's whole-model state; each is also written
    against the consumed tokens (Megatron-DeepSpeed's second axis), at every point."""
    root, _, summary = launched
    tags = scalars(root)
    reference = _reference_states(root / "ckpt")
    tokens_per_step = summary["tokens"] // ITERS
    for tag in OPTIMIZER_TAGS:
        assert [s for s, _ in tags[tag]] == STEPS, tag
        assert tags[tag][-1][1] == pytest.approx(reference[tag], rel=1e-5), tag
        assert tags[f"{tag} vs tokens"] == [(s * tokens_per_step, v) for s, v in tags[tag]]
    last = [line for line in json_lines(root) if "optimizer/weight_l2" in line][-1]
    assert last["iteration"] == ITERS
    for tag in OPTIMIZER_TAGS:
        assert last[tag] == pytest.approx(reference[tag], rel=1e-5), tag
    # Adam's moments follow the training: the momentum grows from its first step's.
    momentum = [v for _, v in tags["optimizer/momentum_l2"]]
    assert momentum[0] > 0 and len(set(momentum)) == ITERS


@pytest.mark.timeout(600)
def test_progress_log_is_megatron_lms(launched):
    """progress.txt in --save: ``Starting job``, then a ``Saved checkpoint`` line per
    checkpoint (iterations 2 and 4) with Megatron-LM's fields; the operations are Megatron's
    formula over the samples so far, the tokens those samples' tokens."""
    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.config.shape import parameter_count
    from megatron_streaming.run.flops import floating_point_operations

    root, _, summary = launched
    lines = (root / "ckpt" / "progress.txt").read_text().splitlines()
    head = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\tJob ID: [^\t]*\t# GPUs: 2\t"
    assert re.fullmatch(head + "Starting job", lines[0]), lines[0]
    cfg = parse_args([*TINY, *MODEL])
    padded = next(v for v in range(128, 2**20, 128)
                  if parameter_count(cfg.model, v) == summary["parameters"])
    per_step = summary["samples"] // ITERS
    assert len(lines) == 1 + ITERS // SAVE_INTERVAL
    for line, iteration in zip(lines[1:], range(SAVE_INTERVAL, ITERS + 1, SAVE_INTERVAL)):
        operations = floating_point_operations(cfg.model, padded, iteration * per_step)
        match = re.fullmatch(
            head + rf"Saved checkpoint\tIteration: {iteration}\t"
            r"Job throughput: (\d+\.\d) TFLOP/s/GPU\tCumulative throughput: (\d+\.\d) "
            r"TFLOP/s/GPU\tFloating-point operations: " + re.escape(f"{operations:.2e}") +
            r"\tTokens \(in billions\): " + re.escape(f"{iteration * per_step * SEQ / 1e9:.2f}"),
            line)
        assert match, line


def test_tensorboard_writer_queues_as_many_events_as_asked(monkeypatch, tmp_path):
    """--tensorboard-queue-size is the SummaryWriter's max_queue (Megatron-LM's 1000 by
    default); a point no longer forces its events to disk (the writer's close does, which
    the run calls on every way out)."""
    import torch.utils.tensorboard

    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.run.metrics import make_writer

    made = []

    class Recording:
        def __init__(self, **kwargs):
            made.append(self)
            self.kwargs, self.events, self.flushes, self.closed = kwargs, [], 0, False

        def add_scalar(self, *args):
            self.events.append(args)

        def flush(self):
            self.flushes += 1

        def close(self):
            self.closed = True

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", Recording)
    for flags, queue in (([], 1000), (["--tensorboard-queue-size", "7"], 7)):
        cfg = parse_args(["--mock-data", "--tensorboard-dir", str(tmp_path), *flags])
        writer = make_writer(cfg.logging, True, cfg)
        writer.scalars(1, {"lm loss": 2.0}, samples=4)
        writer.vs_tokens(128, {"optimizer/weight_l2": 3.0})
        writer.close()
        w = made[-1]
        assert w.kwargs == {"log_dir": str(tmp_path), "max_queue": queue}
        assert w.events == [("lm loss", 2.0, 1), ("lm loss vs samples", 2.0, 4),
                            ("optimizer/weight_l2 vs tokens", 3.0, 128)]
        assert w.flushes == 0 and w.closed


def test_flags_refuse_what_they_cannot_do():
    from megatron_streaming.cli.arguments import ConfigError, parse_args, validate

    with pytest.raises(ConfigError, match="--tensorboard-queue-size must be > 0, got 0"):
        validate(parse_args(["--mock-data", "--tensorboard-queue-size", "0"]), 1)
    with pytest.raises(ConfigError, match="--log-optimizer-states-to-tensorboard writes "
                       "Adam's moments; --optimizer sgd keeps none"):
        validate(parse_args(["--mock-data", "--log-optimizer-states-to-tensorboard",
                             "--optimizer", "sgd"]), 1)


# ---- which elements a rank counts ---------------------------------------------------------

def _model_and_engine(zero: bool):
    """A model of three parameters (a TP shard, a replicated norm, the tied embedding) and an
    engine stand-in whose inner optimizer steps this rank's ZeRO partition (``zero``) or the
    parameters themselves."""
    model = torch.nn.Module()
    model.shard = torch.nn.Parameter(torch.zeros(4))
    model.shard.tensor_model_parallel = True
    model.norm = torch.nn.Parameter(torch.zeros(3))
    model.embedding = torch.nn.Parameter(torch.zeros(6))
    model.embedding.tensor_model_parallel = True  # split by vocabulary rows
    params = [model.shard, model.norm, model.embedding]
    if zero:
        # Rank 1 of 2 over a flat of 13 elements padded to 14: elements 7..13, i.e. the
        # embedding's 6 and one element of padding.
        partition = torch.zeros(7)
        views = [[(model.embedding, partition.narrow(0, 0, 6))]]
        stepped = [partition]
    else:
        views = [[(p, p) for p in params]]
        stepped = params
    optimizer = torch.optim.SGD(stepped, lr=0.1)
    engine = SimpleNamespace(zero=zero, inner_optimizer=optimizer, step_hooks=[],
                             master_views=lambda: views)
    model.shared_embedding_or_output_weight = lambda: model.embedding
    model.share_embeddings_and_output_weights = True
    return model, engine, stepped


def _topology(tp=0, dp=0, pp=0, pp_size=1):
    return SimpleNamespace(coords={"tp": tp, "sp": 0, "dp": dp, "pp": pp},
                           expert_coords={"etp": tp, "ep": 0, "edp": dp},
                           is_first_stage=pp == 0, layout=SimpleNamespace(pp=pp_size),
                           groups={"embd": None})


def test_each_element_is_counted_on_one_rank():
    from megatron_streaming.run.optimizer_report import counted_spans

    model, engine, (shard, norm, embedding) = _model_and_engine(zero=False)
    whole = {id(shard): [(0, 4)], id(norm): [(0, 3)], id(embedding): [(0, 6)]}
    assert counted_spans(engine, _topology(), model) == whole
    # A replicated parameter counts on TP rank 0 only, a shard on every TP rank.
    assert counted_spans(engine, _topology(tp=1), model) == \
        {**whole, id(norm): []}
    # Without ZeRO every data-parallel rank holds it all: the first one counts.
    assert counted_spans(engine, _topology(dp=1), model) == \
        {id(shard): [], id(norm): [], id(embedding): []}
    # The last stage's copy of the tied embedding is the first stage's.
    assert counted_spans(engine, _topology(pp=1, pp_size=2), model) == \
        {**whole, id(embedding): []}
    # ZeRO: this rank's partition, its padding left out.
    model, engine, (partition,) = _model_and_engine(zero=True)
    assert counted_spans(engine, _topology(dp=1), model) == {id(partition): [(0, 6)]}


def test_grad_zeros_counts_in_the_optimizers_step_where_due():
    from megatron_streaming.run.optimizer_report import CountedSpans, GradZeros

    model, engine, (partition,) = _model_and_engine(zero=True)
    zeros = GradZeros(CountedSpans(engine, _topology(), model), due=lambda step: step % 2 == 0)
    # The gradient as the step sees it: 2 zeros among the embedding's 6, 1 in the padding.
    partition.grad = torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0, 4.0, 0.0])
    counts = []
    for step in (1, 2):
        zeros.before_step(step)
        engine.inner_optimizer.step()
        zeros.after_step()
        counts.append(zeros._count)
    assert counts[0] is None and int(counts[1]) == 2
    zeros.before_step(4)  # due, but the optimizer skips its step (an overflow)
    zeros.after_step()
    assert zeros._count is None
    zeros.detach()
    # Without ZeRO a second data-parallel rank counts nothing, and says 0 (not "no count").
    model, engine, params = _model_and_engine(zero=False)
    for p in params:
        p.grad = torch.zeros_like(p)
    zeros = GradZeros(CountedSpans(engine, _topology(dp=1), model), due=lambda step: True)
    zeros.before_step(1)
    engine.inner_optimizer.step()
    assert int(zeros._count) == 0


# ---- progress.txt -------------------------------------------------------------------------

class Clock:
    def __init__(self, start: datetime):
        self.now = start

    def __call__(self) -> datetime:
        return self.now


def _log(directory, clock, world, start_iteration, started):
    from megatron_streaming.run.progress_log import ProgressLog

    # 1e12 operations per iteration, 1e6 tokens.
    return ProgressLog(str(directory), world, lambda i: 1e12 * i, lambda i: 10**6 * i,
                       start_iteration, started, now=clock)


def test_progress_log_throughputs_as_megatron_computes_them(tmp_path):
    """Job throughput: this job's operations over its time; cumulative: since the first
    ``Starting job`` of the latest run of lines of this world size, from the operations of
    the last ``Saved checkpoint`` before it. A job of another world size starts it anew."""
    t0 = datetime(2026, 1, 1, 12, 0, 0)
    clock = Clock(t0)
    first = _log(tmp_path, clock, 2, 0, t0.timestamp())
    first.job_started()
    clock.now = t0 + timedelta(seconds=10)
    first.saved(10)  # 10e12 operations in 10 s on 2 ranks: 0.5 TFLOP/s/GPU
    clock.now = t0 + timedelta(seconds=20)
    # A resumed job at iteration 10, started 5 s before its own line (its set-up).
    second = _log(tmp_path, clock, 2, 10, (t0 + timedelta(seconds=15)).timestamp())
    second.job_started()
    clock.now = t0 + timedelta(seconds=25)
    second.saving_in_background(30)  # 20e12 in 10 s: 1.0 per GPU; cumulative 30e12 in 25 s
    clock.now = t0 + timedelta(seconds=26)
    second.saved(30, background=True)
    clock.now = t0 + timedelta(seconds=40)
    third = _log(tmp_path, clock, 4, 30, (t0 + timedelta(seconds=40)).timestamp())
    third.job_started()
    clock.now = t0 + timedelta(seconds=50)
    third.saved(70)  # 40e12 in 10 s on 4 ranks: 1.0; cumulative from this job's start
    lines = (tmp_path / "progress.txt").read_text().splitlines()

    def stamp(seconds):
        return (t0 + timedelta(seconds=seconds)).strftime("%Y-%m-%d %H:%M:%S")

    assert lines == [
        f"{stamp(0)}\tJob ID: \t# GPUs: 2\tStarting job",
        f"{stamp(10)}\tJob ID: \t# GPUs: 2\tSaved checkpoint\tIteration: 10\tJob throughput: "
        "0.5 TFLOP/s/GPU\tCumulative throughput: 0.5 TFLOP/s/GPU\tFloating-point operations: "
        "1.00e+13\tTokens (in billions): 0.01",
        f"{stamp(20)}\tJob ID: \t# GPUs: 2\tStarting job",
        f"{stamp(25)}\tJob ID: \t# GPUs: 2\tSaving async checkpoint\tIteration: 30\tJob "
        "throughput: 1.0 TFLOP/s/GPU\tCumulative throughput: 0.6 TFLOP/s/GPU\tFloating-point "
        "operations: 3.00e+13\tTokens (in billions): 0.03",
        f"{stamp(26)}\tJob ID: \t# GPUs: 2\tSaved async checkpoint\tIteration: 30",
        f"{stamp(40)}\tJob ID: \t# GPUs: 4\tStarting job",
        # Megatron-LM reads the start operations from "Saved checkpoint" lines only: 1e13.
        f"{stamp(50)}\tJob ID: \t# GPUs: 4\tSaved checkpoint\tIteration: 70\tJob throughput: "
        "1.0 TFLOP/s/GPU\tCumulative throughput: 1.5 TFLOP/s/GPU\tFloating-point operations: "
        "7.00e+13\tTokens (in billions): 0.07"]


def test_progress_log_needs_save_and_the_reporting_rank(tmp_path):
    from megatron_streaming.run.progress_log import ProgressLog

    off = ProgressLog(None, 2, lambda i: 0.0, lambda i: 0, 0, 0.0)
    off.job_started()
    off.saved(1)
    elsewhere = ProgressLog(str(tmp_path), 2, lambda i: 0.0, lambda i: 0, 0, 0.0,
                            writes=lambda: False)
    elsewhere.job_started()
    elsewhere.saved(1)
    assert not (tmp_path / "progress.txt").exists()
