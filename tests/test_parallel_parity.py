"""Every in-worker layout trains the same model: losses equal a single-process run.

Weights are initialised independently of the layout (``megatron_streaming.worker.weights``) and the
data order depends only on the global batch, so TP, PP, Megatron sequence parallelism and
ZeRO data parallelism must reproduce the single-process losses up to float reordering.
Gradient clipping is active (``--clip-grad 0.5`` with norms around 1), so a gradient norm
that double-counts or misses a shard changes the losses too.

Megatron sequence-parallel layouts run through ``tests/tp_reductions_driver.py``, which also
counts the gradient fix-ups' all-reduces on the tensor-parallel group: one per step, however
many micro-batches and parameters.
"""

import json

import pytest

from harness import TINY, LaunchAhead, train_losses

ITERS = ["--train-iters", "4", "--eval-iters", "0"]
DECOUPLED = ["--decoupled-lr", "3e-3", "--decoupled-min-lr", "3e-4"]
MOE_BIASED = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
              "--moe-z-loss-coeff", "0.001"]
MOE = [*MOE_BIASED, "--disable-bias-linear"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train_losses(1, [*TINY, *ITERS], tmp_path_factory.mktemp("ref"))


LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    # 2 micro-batches per step at ZeRO-1; at ZeRO-2 over DP=2, whose partitions cut a
    # sequence-parallel parameter in two.
    "tp2_sequence_parallel": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2_sequence_parallel_zero2_dp2": (4, ["--tensor-model-parallel-size", "2",
                                            "--sequence-parallel", "--zero-stage", "2",
                                            "--micro-batch-size", "1", "--num-layers", "3"]),
    # Megatron-LM's Llama-3 flags (ZeRO-1: no overlap, noted), and overlap_comm at ZeRO-2.
    "zero1_dp2": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce"]),
    "zero2_dp2": (2, ["--zero-stage", "2", "--overlap-grad-reduce"]),
    "zero0_dp2": (2, ["--zero-stage", "0"]),
    "pp2_untied_zero1": (2, ["--pipeline-model-parallel-size", "2",
                             "--untie-embeddings-and-output-weights"]),
    "tp2_rope": (2, ["--tensor-model-parallel-size", "2", "--position-embedding-type", "rope"]),
    # DeepSpeed-Ulysses: each rank holds half of every sequence.
    "ulysses_sp2": (2, ["--ds-sequence-parallel-size", "2"]),
    "ulysses_sp2_tp2": (4, ["--ds-sequence-parallel-size", "2",
                            "--tensor-model-parallel-size", "2"]),
    "ulysses_sp2_zero2_dp2": (4, ["--ds-sequence-parallel-size", "2", "--zero-stage", "2"]),
    "ulysses_sp2_pp2_rope": (4, ["--ds-sequence-parallel-size", "2",
                                 "--pipeline-model-parallel-size", "2",
                                 "--position-embedding-type", "rope"]),
    # Ladder residual: the same ladder model whatever the layout.
    "ladder_tp2": (2, ["--tensor-model-parallel-size", "2", "--ladder-residual"]),
    "ladder_pp2": (2, ["--pipeline-model-parallel-size", "2", "--ladder-residual"]),
    "ladder_upper_half_tp2_pp2": (4, ["--tensor-model-parallel-size", "2",
                                      "--pipeline-model-parallel-size", "2",
                                      "--ladder-layers", "last:2"]),
    # Mixture of experts (its own reference): experts with biases spread over EP=2, reached
    # by alltoall, capacity 1 dropping tokens as one process does (each router call sees one
    # micro-batch of two samples either way; the one process's biased experts need
    # patches.megatron_moe.unshared_expert_outputs); TP2 x EP2 with Megatron sequence parallelism and SwiGLU
    # experts; PP2 x EP2 (ZeRO-1: ZeRO-2 does not go with PP).
    "moe_ep2_alltoall_capacity": (2, [*MOE_BIASED, "--expert-model-parallel-size", "2",
                                      "--moe-token-dispatcher-type", "alltoall",
                                      "--moe-expert-capacity-factor", "1.0", "--zero-stage",
                                      "2"]),
    "moe_tp2_ep2_sequence_parallel": (4, [*MOE, "--expert-model-parallel-size", "2",
                                          "--tensor-model-parallel-size", "2",
                                          "--sequence-parallel"]),
    # Ulysses: the experts over the two sequence ranks, the router's statistics summed over
    # them (the reference routes whole sequences).
    "moe_ulysses_sp2_ep2": (2, [*MOE, "--expert-model-parallel-size", "2",
                                "--ds-sequence-parallel-size", "2"]),
    "moe_pp2_ep2": (4, [*MOE, "--expert-model-parallel-size", "2",
                        "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]),
    # --decoupled-lr: the middle stage holds no embedding yet has the third param group.
    "pp3_decoupled_lr": (3, ["--pipeline-model-parallel-size", "3", "--num-layers", "3",
                             *DECOUPLED]),
}
# Layouts whose model differs from the shared reference's: compared with their own.
OWN_REFERENCE = {"pp2_untied_zero1": ["--untie-embeddings-and-output-weights"],
                 # An odd layer count, so that the partitions cut a parameter in two.
                 "tp2_sequence_parallel_zero2_dp2": ["--num-layers", "3"],
                 "tp2_rope": ["--position-embedding-type", "rope"],
                 "ulysses_sp2_pp2_rope": ["--position-embedding-type", "rope"],
                 "ladder_tp2": ["--ladder-residual"], "ladder_pp2": ["--ladder-residual"],
                 "ladder_upper_half_tp2_pp2": ["--ladder-layers", "last:2"],
                 "pp3_decoupled_lr": ["--num-layers", "3", *DECOUPLED],
                 "moe_ep2_alltoall_capacity": [*MOE_BIASED, "--moe-expert-capacity-factor",
                                               "1.0"],
                 "moe_tp2_ep2_sequence_parallel": [*MOE, "--sequence-parallel"],
                 "moe_ulysses_sp2_ep2": MOE,
                 "moe_pp2_ep2": [*MOE, "--global-batch-size", "8"]}


def _runs(name, tmp_path) -> dict:
    """The layout's run, and beside it its own reference where it has one (start-ups leave
    cores idle)."""
    nproc, extra = LAYOUTS[name]
    args = [*TINY, *ITERS, *extra]
    layout = (nproc, args, {"TP_REDUCTIONS_DIR": str(tmp_path)},
              "tests/tp_reductions_driver.py") if "--sequence-parallel" in extra \
        else (nproc, args)
    runs = {"run": layout}
    if name in OWN_REFERENCE:
        runs["own_ref"] = (1, [*TINY, *ITERS, *OWN_REFERENCE[name]])
    return runs


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    """Each layout's launch starts while the previous layout's runs."""
    ahead = LaunchAhead.for_test(request, "test_layout_matches_single_process", "name", _runs,
                                 tmp_path_factory)
    yield ahead
    ahead.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_single_process(name, reference, launches):
    nproc, extra = LAYOUTS[name]
    driven = "--sequence-parallel" in extra
    runs = launches.take(name)
    together, tmp_path = runs.losses(), runs.tmp_path
    losses, ref = together["run"], together.get("own_ref", reference)
    if driven:
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
        # One coalesced all-reduce per step, not one per parameter (6 a layer, 2 in the
        # final norm) per micro-batch (2 here).
        assert all(r["per_step"] == [1, 1, 1, 1] for r in ranks), ranks
        assert ranks[0]["sequence_parallel_params"] >= 20
        if "--zero-stage" in extra:  # ZeRO-2: summed in its step, on each rank's partition
            assert any(r["cut"] for r in ranks), ranks
    assert len(losses) == len(ref) == 4
    assert losses == pytest.approx(ref, rel=1e-5, abs=0)
    # The model learns: a parity test on a frozen model would prove nothing.
    assert losses[-1] < losses[0]
