"""Bad input ends with one clear error naming the flag and the value: exit status 2, no
Python traceback, and, where the input can be checked alone, before any process-group work.

Pure validation is checked in-process (``parse_args`` + ``validate``); one subprocess per
kind of error (layout, tokenizer, ``--load``) proves the path a user sees. A single process
told ``WORLD_SIZE=N > 1`` would wait forever in ``init_process_group`` for the other ranks,
so such a run exiting at once shows the error came before any collective.
"""

import importlib.util
import shutil
from pathlib import Path

import pytest

from harness import REPO, SHARED_DATA, free_port, run
from megatron_streaming.cli.arguments import ConfigError, parse_args, validate

pytestmark = pytest.mark.filterwarnings(
    "ignore:Transformer Engine and Apex are not installed:UserWarning")

# Default model (2 layers, hidden 64): cheap enough to save a real checkpoint.
MOCK = ["--mock-data", "--eval-iters", "0"]
SUBPROCESS_TIMEOUT = 120  # far below the 10-minute rendezvous wait of a stuck rank


def _one_process_env() -> dict:
    """A world of one on its own port: runs of other tests may hold the default 29500."""
    return {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": str(free_port())}


def _fails_cleanly(args, *expected, world_size=None):
    """Run pretrain_gpt.py as one process; assert exit 2 and one error line with ``expected``."""
    extra = _one_process_env()
    if world_size is not None:
        extra["WORLD_SIZE"] = str(world_size)
    proc = run(1, args, timeout=SUBPROCESS_TIMEOUT, check=False, extra_env=extra)
    output = f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    assert proc.returncode == 2, output
    assert "Traceback" not in proc.stderr, output
    errors = [line for line in proc.stderr.splitlines()
              if line.startswith("pretrain_gpt.py: error:")]
    assert len(errors) == 1, output
    for text in expected:
        assert text in errors[0], output
    return errors[0]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A real tiny indexed dataset and its tokenizer: ~20 KB of tinyshakespeare, 256 pieces."""
    from megatron_streaming.data.__main__ import main as preprocess

    root = tmp_path_factory.mktemp("data")
    text = (SHARED_DATA / "tinyshakespeare.txt").read_bytes()[:20_000].decode("utf-8", "ignore")
    (root / "small.txt").write_text(text, encoding="utf-8")
    prefix = str(root / "small")
    assert preprocess(["--input", str(root / "small.txt"), "--output-prefix", prefix,
                       "--vocab-size", "256"]) == 0
    return {"prefix": prefix, "model": prefix + ".model"}


# ---- pure validation, in-process -------------------------------------------------------------

VALIDATION_CASES = {
    # name: (flags, world size, texts the message must contain)
    "world_not_divisible_by_tp": (
        ["--mock-data", "--tensor-model-parallel-size", "4"], 6,
        ["world size 6", "--tensor-model-parallel-size (4)"]),
    "world_not_divisible_by_workers": (
        ["--mock-data", "--diloco-workers", "4"], 2,
        ["world size 2", "--diloco-workers (4)"]),
    "heads_not_divisible_by_tp": (
        ["--mock-data", "--hidden-size", "96", "--num-attention-heads", "6",
         "--tensor-model-parallel-size", "4"], 4,
        ["--num-attention-heads (6)", "--tensor-model-parallel-size (4)"]),
    "layers_not_divisible_by_pp": (
        ["--mock-data", "--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2,
        ["--num-layers (3)", "--pipeline-model-parallel-size (2)"]),
    "zero2_with_pipeline": (
        ["--mock-data", "--zero-stage", "2", "--pipeline-model-parallel-size", "2"], 2,
        ["--zero-stage 2", "--pipeline-model-parallel-size 2"]),
    "fp16_and_bf16": (
        ["--mock-data", "--fp16", "--bf16"], 1, ["--fp16", "--bf16", "mutually exclusive"]),
    "no_data_source": (
        [], 1, ["--data-path", "--train-data-path", "--mock-data"]),
    "missing_data_path": (
        ["--data-path", "/nonexistent/prefix", "--tokenizer-model", "TOKENIZER"], 1,
        ["--data-path /nonexistent/prefix", "/nonexistent/prefix.bin does not exist"]),
    "missing_tokenizer_file": (
        ["--data-path", "PREFIX", "--tokenizer-model", "/nonexistent/tok.model"], 1,
        ["--tokenizer-model /nonexistent/tok.model", "not a readable file"]),
    "data_path_without_tokenizer": (
        ["--data-path", "PREFIX"], 1, ["--tokenizer-model (or --tokenizer-type", "is required",
                                       "--data-path"]),
    # Streaming DiLoCo (checked whatever the number of workers).
    "inner_steps_not_divisible_by_fragments": (
        ["--mock-data", "--num-layers", "4", "--diloco-inner-steps", "10",
         "--diloco-fragments", "4"], 1,
        ["--diloco-inner-steps (10)", "--diloco-fragments (4)"]),
    "overlap_not_below_interval": (
        ["--mock-data", "--num-layers", "2", "--diloco-inner-steps", "10",
         "--diloco-fragments", "2", "--diloco-overlap-steps", "5"], 1,
        ["--diloco-overlap-steps (5)", "H/P = 10/2 = 5"]),
    "negative_overlap": (
        ["--mock-data", "--diloco-overlap-steps", "-1"], 1, ["--diloco-overlap-steps (-1)"]),
    "alpha_out_of_range": (
        ["--mock-data", "--diloco-alpha", "1.5"], 1, ["--diloco-alpha", "1.5"]),
    "more_fragments_than_layers": (
        ["--mock-data", "--num-layers", "2", "--diloco-inner-steps", "30",
         "--diloco-fragments", "3"], 1, ["--diloco-fragments (3)", "--num-layers (2)"]),
    "fragment_layers_not_dividing": (
        ["--mock-data", "--num-layers", "4", "--diloco-fragment-layers", "3"], 1,
        ["--diloco-fragment-layers (3)", "--num-layers (4)"]),
    "bad_quant_block": (
        ["--mock-data", "--diloco-quant-block", "127"], 1, ["--diloco-quant-block 127"]),
    "outer_momentum_out_of_range": (
        ["--mock-data", "--diloco-outer-momentum", "1.5"], 1,
        ["--diloco-outer-momentum (1.5)"]),
    "control_lag_below_one": (
        ["--mock-data", "--diloco-control-lag", "0"], 1,
        ["--diloco-control-lag must be >= 1, got 0"]),
    "world_not_divisible_by_workers_times_ranks": (
        ["--mock-data", "--diloco-workers", "2", "--tensor-model-parallel-size", "2"], 6,
        ["world size 6", "--diloco-workers (2)", "--tensor-model-parallel-size (2)"]),
    # Ulysses and Ladder residual.
    "heads_not_divisible_by_tp_times_sp": (
        ["--mock-data", "--num-attention-heads", "4", "--tensor-model-parallel-size", "2",
         "--ds-sequence-parallel-size", "4"], 8,
        ["--num-attention-heads", "4", "--ds-sequence-parallel-size", "4"]),
    "seq_not_divisible_by_sp": (
        ["--mock-data", "--seq-length", "30", "--ds-sequence-parallel-size", "4"], 4,
        ["--seq-length", "30", "--ds-sequence-parallel-size", "4"]),
    "world_not_divisible_by_sp": (
        ["--mock-data", "--ds-sequence-parallel-size", "4"], 6,
        ["world size 6", "--ds-sequence-parallel-size (4)"]),
    "bad_ladder_layers": (
        ["--mock-data", "--num-layers", "4", "--ladder-layers", "2-9"], 1,
        ["--ladder-layers", "2-9"]),
    "ladder_with_megatron_sequence_parallel": (
        ["--mock-data", "--ladder-residual", "--tensor-model-parallel-size", "2",
         "--sequence-parallel"], 2, ["--ladder-residual", "--sequence-parallel"]),
    "nccl_without_gpu": (
        ["--mock-data", "--diloco-backend", "nccl"], 1, ["--diloco-backend nccl", "no GPU"]),
    "load_missing_directory": (
        ["--mock-data", "--load", "/nonexistent/ckpt"], 1,
        ["--load /nonexistent/ckpt", "no such directory"]),
}


@pytest.mark.parametrize("name", sorted(VALIDATION_CASES))
def test_validation_names_the_flag_and_the_value(name, dataset):
    flags, world_size, expected = VALIDATION_CASES[name]
    flags = [{"PREFIX": dataset["prefix"], "TOKENIZER": dataset["model"]}.get(f, f)
             for f in flags]
    cfg = parse_args(flags)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size)
    for text in expected:
        assert text in str(err.value)
    assert "\n" not in str(err.value)


def test_valid_flags_pass_validation(dataset):
    """The cases above fail for the reason named, not because the base flags are bad."""
    validate(parse_args(["--mock-data"]), 1)
    validate(parse_args(["--mock-data", "--tensor-model-parallel-size", "2",
                         "--pipeline-model-parallel-size", "2", "--diloco-workers", "2",
                         "--sequence-parallel"]), 8)
    validate(parse_args(["--data-path", dataset["prefix"], "--tokenizer-model",
                         dataset["model"]]), 1)


def _load_entry_point():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", REPO / "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_entry_point_reports_data_errors_and_keeps_tracebacks_of_bugs(monkeypatch, capsys,
                                                                      tmp_path):
    """The data package's UsageErrors are user errors (exit 2); any other error is a bug."""
    import megatron_streaming.run.train
    from megatron_streaming.data import load_tokenizer

    entry = _load_entry_point()
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a sentencepiece model" * 10)
    monkeypatch.setattr(megatron_streaming.run.train, "pretrain",
                        lambda cfg, extensions=(): load_tokenizer(str(garbage)))
    assert entry.main(["--mock-data"]) == 2
    assert f"pretrain_gpt.py: error: --tokenizer-model '{garbage}'" in capsys.readouterr().err

    def bug(cfg, extensions=()):
        raise ValueError("an internal bug")

    monkeypatch.setattr(megatron_streaming.run.train, "pretrain", bug)
    with pytest.raises(ValueError, match="an internal bug"):
        entry.main(["--mock-data"])


def test_a_setup_that_fails_stops_the_heartbeat_it_started(monkeypatch):
    """A failure inside ``Run.setup`` (a corrupt --load, say) still stops the heartbeat: left
    running, its rendezvous-store call can be in flight while the interpreter exits, and the
    process then aborts ("terminate called without an active exception") instead of exiting
    with 2."""
    import types

    import megatron_streaming.job.lifecycle as lifecycle
    import megatron_streaming.run.start as start
    from megatron_streaming.errors import UsageError
    from megatron_streaming.run.train import Run

    closed = []

    class Heartbeat:
        def __init__(self, *args, **kwargs):
            pass

        def close(self):
            closed.append("heartbeat")

    topology = types.SimpleNamespace(is_logging_rank=lambda: False)
    started = types.SimpleNamespace(topology=topology, tokenizer=None, job=None, resume=None,
                                    resume_plan=None, rejoin=None, own_processes=True,
                                    patches=(), rendezvous=None)
    monkeypatch.setattr(start, "start_processes", lambda cfg: started)
    monkeypatch.setattr(lifecycle, "Liveness", Heartbeat)
    monkeypatch.setattr(lifecycle, "StopAgreement", lambda *args: types.SimpleNamespace())

    def refuse(cfg, started):
        raise UsageError("--load /x: altered after it was written")

    monkeypatch.setattr(start, "say_at_start", refuse)
    with pytest.raises(UsageError, match="altered"):
        with Run(parse_args(["--mock-data"])):
            pass
    assert closed == ["heartbeat"]


def test_worker_index_turns_one_launch_into_its_share_of_the_job():
    from megatron_streaming.parallel.distributed import join_worker_launch

    # torchrun on cluster 1 started ranks 0..3 of its own 4: global ranks 4..7 of 8.
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "MASTER_ADDR": "node-b",
           "MASTER_PORT": "29400", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    join_worker_launch(env, workers=2, worker_index=1, master_addr="node-a", master_port=6000)
    assert env == {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "MASTER_ADDR": "node-a",
                   "MASTER_PORT": "6000"}
    untouched = {"RANK": "1", "WORLD_SIZE": "4"}
    join_worker_launch(untouched, workers=2, worker_index=None, master_addr=None,
                       master_port=None)
    assert untouched == {"RANK": "1", "WORLD_SIZE": "4"}
    with pytest.raises(ConfigError, match=r"--diloco-worker-index must be in \[0, "
                       r"--diloco-workers \(2\)\), got 2"):
        join_worker_launch({"WORLD_SIZE": "4"}, 2, 2, "node-a", None)
    with pytest.raises(ConfigError, match="--diloco-worker-index needs --master-addr"):
        join_worker_launch({"WORLD_SIZE": "4"}, 2, 0, None, None)


# ---- the user-facing path: one process of pretrain_gpt.py ------------------------------------

@pytest.mark.timeout(180)
def test_layout_error_exits_before_process_groups():
    _fails_cleanly(["--mock-data", "--tensor-model-parallel-size", "4"],
                   "world size 6", "--tensor-model-parallel-size (4)", world_size=6)


@pytest.mark.timeout(180)
def test_unreadable_tokenizer_exits_before_process_groups(dataset, tmp_path):
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(bytes(range(256)) * 16)
    # WORLD_SIZE=2 is a valid layout (DP=2): only the tokenizer is wrong, and a rank that got
    # as far as init_process_group would wait for a second rank that never comes.
    _fails_cleanly(["--data-path", dataset["prefix"], "--tokenizer-model", str(garbage)],
                   f"--tokenizer-model '{garbage}'", "not a valid sentencepiece model",
                   world_size=2)


@pytest.mark.timeout(180)
def test_load_of_missing_directory(tmp_path):
    missing = tmp_path / "no_such_dir"
    _fails_cleanly([*MOCK, "--load", str(missing)], f"--load {missing}", "no such directory",
                   world_size=2)


@pytest.mark.timeout(180)
def test_load_of_directory_without_checkpoint(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails_cleanly([*MOCK, "--load", str(empty)], f"--load {empty}",
                   "no checkpoint in this directory")


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """A real checkpoint of a 2-iteration single-process run."""
    root = tmp_path_factory.mktemp("ckpt") / "saved"
    run(1, [*MOCK, "--train-iters", "2", "--save", str(root)], timeout=SUBPROCESS_TIMEOUT,
        extra_env=_one_process_env())
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    return root


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _garbage_same_size(path: Path) -> None:
    size = path.stat().st_size
    path.write_bytes((bytes(range(256)) * (size // 256 + 1))[:size])


class _RunsCode:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/megatron_streaming_pwned",))


def _code_carrying_pickle(path: Path) -> None:
    """Replace the file by a pickle that would run a command, and make checkpoint.json agree
    with it (size, SHA-256): only the restricted unpickler stands in the way."""
    import hashlib
    import json
    import pickle

    data = pickle.dumps(_RunsCode())
    path.write_bytes(data)
    meta_path = path.parent.parent / "checkpoint.json"  # the part is worker0/
    meta = json.loads(meta_path.read_text())
    meta["files"][f"{path.parent.name}/{path.name}"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta_path.write_text(json.dumps(meta))


CORRUPTIONS = {
    "truncated_tensor_file": ("iter_0000002/worker0/__0_0.distcp", _truncate,
                              ["__0_0.distcp is truncated or altered"]),
    "garbage_tensor_file": ("iter_0000002/worker0/__0_0.distcp", _garbage_same_size,
                            ["__0_0.distcp was altered after it was written"]),
    "missing_metadata": ("iter_0000002/checkpoint.json", Path.unlink,
                         ["is incomplete or corrupt", "checkpoint.json"]),
    "code_carrying_metadata": ("iter_0000002/worker0/.metadata", _code_carrying_pickle,
                               [".metadata is not checkpoint metadata", "posix.system"]),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_load_of_corrupt_checkpoint(name, checkpoint_dir, tmp_path):
    relative, corrupt, expected = CORRUPTIONS[name]
    root = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir, root)
    corrupt(root / relative)
    _fails_cleanly([*MOCK, "--train-iters", "4", "--load", str(root)], f"--load {root}",
                   *expected)
    assert not Path("/tmp/megatron_streaming_pwned").exists()


REFUSED_CHANGES = {
    "width": (["--hidden-size", "128"],
              "the checkpoint's model has --hidden-size 64, this run 128; the architecture "
              "cannot change on resume"),
    "optimizer": (["--optimizer", "sgd"],
                  "the checkpoint was trained with --optimizer adam, this run has --optimizer "
                  "sgd"),
    "vocabulary": (["--vocab-size", "512"],
                   "the checkpoint's vocabulary has 256 tokens, this run's tokenizer 512"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(REFUSED_CHANGES))
def test_load_refuses_what_it_cannot_honour_before_process_groups(name, checkpoint_dir):
    """Checked from the checkpoint's JSON alone: WORLD_SIZE 2 with one process would hang at
    the first collective, so the refusal comes before any."""
    flags, expected = REFUSED_CHANGES[name]
    _fails_cleanly([*MOCK, *flags, "--train-iters", "4", "--load", str(checkpoint_dir)],
                   f"--load {checkpoint_dir}: {expected}", world_size=2)


@pytest.mark.timeout(180)
def test_unwritable_save_exits_before_process_groups(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    target = blocker / "ckpt"
    _fails_cleanly([*MOCK, "--save", str(target)], f"--save {target} is not writable",
                   "Not a directory", world_size=2)


def test_launches_probing_one_save_directory_at_once_do_not_trip_each_other(tmp_path):
    """Every launch numbers its ranks from 0 until the door, so two workers' rank 1 probe one
    --save together; with one probe name per rank, one removed the other's file (ENOENT)."""
    from concurrent.futures import ThreadPoolExecutor

    from megatron_streaming.checkpoint import check_writable

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: [check_writable(str(tmp_path), 1) for _ in range(200)],
                      range(8)))
    assert list(tmp_path.iterdir()) == []


def test_a_one_line_report_quotes_an_errors_first_line_or_its_type():
    """Every one-line report of an error from below goes through ``first_line``: an error
    without a message (several stores and libraries raise them) is named by its type instead
    of failing the report with an IndexError."""
    from megatron_streaming.errors import first_line

    assert first_line(OSError("No space left on device\nmore detail")) == \
        "No space left on device"
    assert first_line(ValueError("")) == "ValueError"
    assert first_line(RuntimeError("  \n")) == "RuntimeError"
