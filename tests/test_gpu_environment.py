"""What a GPU cluster's environment changes, checked on the CPU: the cross-worker backend's
default and what NCCL across workers refuses, stand-in apex and Transformer Engine packages
(``tests/stand_ins``), the norms and names a Transformer Engine model has.
"""

import pytest

from megatron_streaming.cli.arguments import ConfigError, _check_cross_worker_nccl, parse_args

pytestmark = pytest.mark.filterwarnings(
    "ignore:Transformer Engine and Apex are not installed:UserWarning")


# ---- the cross-worker backend -----------------------------------------------------------

def test_gloo_crosses_workers_unless_nccl_is_asked_for():
    cfg = parse_args(["--mock-data", "--diloco-workers", "2"])
    assert cfg.streaming.diloco_backend == "gloo"
    _check_cross_worker_nccl(cfg, have_cuda=True)  # nothing to say about gloo
    assert cfg.warnings == []
    nccl = parse_args(["--mock-data", "--diloco-workers", "2", "--diloco-backend", "nccl",
                       "--diloco-timeout", "300"])
    _check_cross_worker_nccl(nccl, have_cuda=True)
    assert len(nccl.warnings) == 1 and "has not run" in nccl.warnings[0]


@pytest.mark.parametrize("flags,have_cuda,message", [
    ([], False, "--diloco-backend nccl needs CUDA"),
    (["--diloco-timeout", "300", "--diloco-workers", "3", "--diloco-min-workers", "2"], True,
     "--diloco-min-workers 2 needs --diloco-backend gloo"),
    # the defaults: 600 s across workers, 10 minutes inside: the in-worker watchdog would fire
    ([], True, "--diloco-timeout 600 s must be below --distributed-timeout-minutes 10 (600 s)"),
])
def test_nccl_across_workers_refuses_what_cannot_work(flags, have_cuda, message):
    cfg = parse_args(["--mock-data", "--diloco-workers", "2", "--diloco-backend", "nccl",
                      *flags])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _check_cross_worker_nccl(cfg, have_cuda)


# ---- norms: chosen, not taken from what imports -----------------------------------------

@pytest.mark.parametrize("normalization,apex,expected", [
    ("LayerNorm", True, "FusedLayerNorm"), ("RMSNorm", True, "WrappedTorchNorm"),
    ("LayerNorm", False, "WrappedTorchNorm"), ("RMSNorm", False, "WrappedTorchNorm")])
def test_every_norm_of_the_model_is_chosen_explicitly(monkeypatch, normalization, apex,
                                                      expected):
    """apex's fused norm refuses RMSNorm, and megatron-core takes it for every norm of the
    local spec whenever apex imports; its block's final norm is Transformer Engine's whenever
    that imports. The model's norms are one choice: apex's for a LayerNorm where its kernel
    imports, torch's elsewhere."""
    from patches import optional

    from megatron_streaming.worker import model
    from megatron_streaming.config import ModelConfig, ParallelConfig

    monkeypatch.setattr(optional, "have_apex_layer_norm", lambda: apex)
    cfg = ModelConfig(num_layers=2, normalization=normalization, transformer_impl="auto")
    spec = model.layer_spec(cfg)
    block = model.block_spec(model.transformer_config(cfg, ParallelConfig()), cfg, spec, 0)
    norms = {spec.submodules.input_layernorm, spec.submodules.pre_mlp_layernorm,
             block.layer_norm}
    assert [n.__name__ for n in norms] == [expected]
    assert len(block.layer_specs) == 2


def test_transformer_engine_names_and_groups_start_and_reduce_as_megatrons(megatron_world):
    """Transformer Engine's fused norm-and-linear names its norm ``layer_norm_weight`` and
    ``layer_norm_bias``: the bias starts at 0 like any bias. Its FP8 amax reduction asks
    megatron-core for the tensor-and-data-parallel group once the model-parallel groups are
    in place: the worker's own."""
    import torch
    from megatron.core import parallel_state

    from megatron_streaming.worker.weights import init_value

    qkv = "decoder.layers.0.self_attention.linear_qkv."
    assert torch.equal(init_value(qkv + "layer_norm_bias", [4], 0.02, 2, 1), torch.zeros(4))
    assert torch.equal(init_value(qkv + "layer_norm_weight", [4], 0.02, 2, 1), torch.ones(4))
    assert torch.equal(init_value(qkv + "layer_norm_weight", [4], 0.02, 2, 1,
                                  zero_centered_norms=True), torch.zeros(4))
    assert parallel_state.model_parallel_is_initialized()
    group = megatron_world.groups["tp_dp"]
    assert parallel_state.get_amax_reduction_group(with_context_parallel=True) is group
    assert parallel_state.get_amax_reduction_group(with_context_parallel=False) is group
    assert megatron_world.group_ranks["tp_dp"] == [0]


# ---- a job in NVIDIA's container: apex and Transformer Engine importable -----------------

@pytest.mark.timeout(300)
def test_a_job_trains_the_same_with_apex_and_transformer_engine_importable(tmp_path):
    """One GPT (LayerNorm) run beside the same with stand-in apex, and with stand-in apex and
    Transformer Engine: the same losses, apex's fused LayerNorm running where it imports, no
    Transformer Engine layer built (its QKV split, which megatron-core's local attention takes
    whenever it imports, runs), and the run saying which layers run and why."""
    from harness import TINY, train_losses_together, with_stand_ins

    args = [*TINY, "--train-iters", "3", "--eval-iters", "0"]
    records = {name: tmp_path / f"{name}.record" for name in ("apex", "container")}
    got = train_losses_together({
        "plain": (1, args),
        "apex": (1, args, with_stand_ins("apex", record=records["apex"])),
        "container": (1, args, with_stand_ins("apex", "transformer_engine",
                                              record=records["container"]))}, tmp_path)
    assert len(got["plain"]) == 3 and got["apex"] == got["plain"] == got["container"]

    def ran(name):
        return sorted(line.split()[0] for line in records[name].read_text().splitlines())

    assert ran("apex") == ["apex.FusedLayerNormAffineFunction"]
    assert ran("container") == ["apex.FusedLayerNormAffineFunction",
                                "transformer_engine._SplitAlongDim"]
    log = (tmp_path / "container.log").read_text()
    assert "--transformer-impl auto: megatron-core's local layers (Transformer Engine " \
        "imports, but its layers are opt-in" in log
    assert "does not import" in (tmp_path / "plain.log").read_text()


# ---- each rank's GPU, set first ----------------------------------------------------------

@pytest.mark.timeout(300)
def test_the_gpu_is_set_before_transformer_engine_imports(tmp_path):
    """Transformer Engine may make a CUDA context at import, on the device current then
    (device 0 unless one was set); megatron-core imports it, and start-up imports
    megatron-core (patches, tokenizer) well before the process group. With CUDA faked (two
    GPUs), the second rank of a launch sets GPU 1 before Transformer Engine imports."""
    import subprocess
    import sys

    from harness import REPO, env, with_stand_ins

    record = tmp_path / "order"
    extra = {**with_stand_ins("transformer_engine"), "STAND_IN_IMPORTS": str(record),
             "FAKE_GPUS": "2", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    subprocess.run([sys.executable, str(REPO / "tests" / "claim_device_driver.py"),
                    "--mock-data"], cwd=REPO, env=env(extra), check=True, timeout=240)
    assert record.read_text().splitlines() == [
        "set_device 1", "transformer_engine imported on device 1", "rendezvous"]


@pytest.mark.parametrize("gpus,rank,world,local_rank,workers,expected", [
    # two one-rank workers in one launch share the one GPU (the device check does that)
    (1, 1, 2, 1, 2, 0),
    # one worker of two ranks on one GPU: refused
    (1, 1, 2, 1, 1, "LOCAL_RANK 1: its worker has at least 2 ranks on this node, which sees "
                    "1 GPU (CUDA_VISIBLE_DEVICES=0): two ranks of one worker would share a GPU"),
    # worker 1's own launch of two ranks (--diloco-worker-index 1): its global rank 3
    (2, 3, 4, 1, 2, 1),
    (1, 3, 4, 1, 2, "LOCAL_RANK 1: its worker has at least 2 ranks on this node, which sees "
                    "1 GPU"),
    # four workers of four on two nodes of eight: rank 13 is worker 3's second on node 1
    (8, 13, 16, 5, 4, 5),
    # eight ranks of one worker on a node of four GPUs
    (4, 6, 8, 6, 1, "LOCAL_RANK 6: its worker has at least 7 ranks on this node, which sees "
                    "4 GPUs"),
])
def test_two_ranks_of_one_worker_never_share_a_gpu(monkeypatch, gpus, rank, world, local_rank,
                                                   workers, expected):
    """Each rank takes GPU LOCAL_RANK % GPUs: two ranks of one worker on one node beyond its
    GPUs would share one (NCCL refuses, gloo runs them slowly on top of each other): refused
    in one line. Ranks of different workers may share (two one-rank workers on one GPU)."""
    import torch

    from megatron_streaming.parallel import distributed

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus))))
    launch = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank)}
    if isinstance(expected, int):
        assert distributed.claim_device(launch, workers) == expected
        assert chosen == [expected]
    else:
        with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            distributed.claim_device(launch, workers)
        assert chosen == []


# ---- NCCL across workers: launch order -----------------------------------------------------

@pytest.mark.parametrize("version,value,refused", [
    ((2, 27, 5), None, None),
    ((2, 26, 2), "1", None),
    ((2, 21, 5), None, "torch's NCCL 2.21.5 cannot order the worker's and the cross-worker "
                       "collectives"),
    ((2, 27, 5), "0", "--diloco-backend nccl needs NCCL_LAUNCH_ORDER_IMPLICIT=1"),
])
def test_nccl_across_workers_has_nccl_follow_the_launch_order(monkeypatch, version, value,
                                                              refused):
    """Operations of two NCCL communicators of one GPU (the worker's, the cross-worker one)
    can deadlock unless every rank launches them in one order and NCCL follows it
    (NCCL_LAUNCH_ORDER_IMPLICIT, NCCL 2.26 and later)."""
    import torch

    from megatron_streaming.parallel import distributed

    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: version)
    env = {} if value is None else {"NCCL_LAUNCH_ORDER_IMPLICIT": value}
    if refused is None:
        distributed.order_nccl_launches(env)
        assert env == {"NCCL_LAUNCH_ORDER_IMPLICIT": "1"}
    else:
        with pytest.raises(ConfigError, match=refused):
            distributed.order_nccl_launches(env)


# ---- the exchange's working set, measured with a peer --------------------------------------

@pytest.mark.timeout(300)
def test_sync_memory_measures_an_exchange_between_two_workers(tmp_path):
    """``benchmarks/gpu_environment.py sync-memory`` rehearsed on the CPU: two workers, so the
    exchange really encodes, crosses and decodes (a transport of one member returns its
    input untouched, and what the planner counts for it was never measured)."""
    import json
    import subprocess
    import sys

    from harness import REPO, env
    from megatron_streaming.comm.codec import make_codec

    numel = 1 << 14
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_environment.py"),
                    "sync-memory", "--rehearse", "--numel", str(numel), "--out", str(tmp_path)],
                   cwd=REPO, env=env(), check=True, timeout=240, capture_output=True)
    result = json.loads((tmp_path / "sync-memory.json").read_text())
    assert result["workers"] == 2 and result["planned_bytes_per_element"] == 17
    # the send and the copy on its way: two exchanges, each the flags and codes each way
    one = 4 + 2 * make_codec("fp4-e2m1", 128).wire_bytes(numel // 2)
    assert [r["bytes_sent"] for r in result["per_rank"]] == [2 * one, 2 * one]
