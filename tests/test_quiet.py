"""Expected upstream warnings show once per job; a real warning still shows."""

import subprocess
import sys

import pytest

from harness import REPO, TINY, run


def test_expected_messages_pass_once_on_rank_0_only():
    from megatron_streaming.run.quiet import OncePerJob

    first, other = OncePerJob(rank=0), OncePerJob(rank=1)
    family = ["Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
              "Transformer Engine and Apex are not installed. Falling back to local kernels"]
    assert [first.passes(m) for m in family] == [True, False]
    assert [other.passes(m) for m in family] == [False, False]
    for f in (first, other):  # anything else always passes
        assert f.passes("gradient overflow at step 3") and f.passes("gradient overflow at step 3")


@pytest.mark.parametrize("rank", [0, 1])
def test_an_unexpected_python_warning_still_shows_on_every_rank(rank):
    code = ("from megatron_streaming.run import quiet; quiet.install(%d); import warnings; "
            "warnings.warn('Apex is not installed. Falling back to Torch Norm'); "
            "warnings.warn('a real problem')" % rank)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert "a real problem" in proc.stderr
    assert ("Apex is not installed" in proc.stderr) == (rank == 0)


@pytest.mark.timeout(300)
def test_two_ranks_print_each_expected_warning_once():
    proc = run(2, [*TINY, "--tensor-model-parallel-size", "2", "--train-iters", "1",
                   "--eval-iters", "0", "--sequence-parallel"])
    out = proc.stdout + proc.stderr
    # (A Python warning also prints its source line, which may repeat the text.)
    for message in ("Setting accelerator to CPU",
                    "UserWarning: Transformer Engine and Apex are not installed",
                    "UserWarning: Apex is not installed. Falling back to Torch Norm"):
        assert out.count(message) == 1, (message, out[-4000:])
    assert "iteration      1/1" in out
