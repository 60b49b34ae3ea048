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
