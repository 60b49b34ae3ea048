"""The checkpoint tools as a user runs them: ``python -m megatron_streaming.checkpoint``
inspect / export-hf / import-hf, on checkpoints written by real training runs.

Export: the Hugging Face model that ``transformers`` loads from the exported directory gives
the logits of our model holding the checkpoint's global (or one worker's local) parameters.
Import: a tiny random ``transformers`` model becomes a checkpoint whose parameters give
transformers' logits in our model, and which ``pretrain_gpt.py --load`` trains from under
another layout and with two workers.
"""

import json
import subprocess

import pytest
import torch

from harness import REPO, TINY, command, env, read_jsonl, run, start
from megatron_streaming.cli.arguments import parse_args
from megatron_streaming.checkpoint import offline

LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--group-query-attention", "--num-query-groups", "2", "--rotary-base", "500000"]
VOCAB, SEQ = 256, 32


def cli(*args, check=True):
    """The tool as a user runs it (a process of its own)."""
    proc = subprocess.run(command(1, ["megatron_streaming.checkpoint", *map(str, args)], "-m"),
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def tool(*args) -> str:
    """The same entry point in this process (no interpreter start-up): its stdout."""
    import contextlib
    import io

    from megatron_streaming.checkpoint.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(a) for a in args]) == 0
    return out.getvalue()


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _our_logits(topo, flags, params):
    """Our model of ``flags`` holding ``params`` (global names, TP=1 shapes)."""
    from megatron_streaming.parallel import distributed
    from megatron_streaming.worker.model import build_model

    cfg = parse_args([*TINY, "--num-layers", "2", *flags])
    distributed.seed_everything(1, 0)
    model = build_model(cfg.model, cfg.parallel, topo, VOCAB, None, cfg.precision)
    for name, p in model.named_parameters():
        p.copy_(params[name][:p.shape[0]] if p.shape != params[name].shape else params[name])
    tokens = _tokens()
    return model.eval()(tokens, torch.arange(SEQ).repeat(2, 1), None)[..., :VOCAB]


@torch.no_grad()
def _hf_logits(directory):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval()(_tokens()).logits


@pytest.mark.timeout(600)
def test_export_of_a_streaming_run_gives_our_logits(tmp_path, megatron_world):
    """Two workers (TP2 each for the Llama-class model, EP2 for the Mixtral-class one): the
    export of theta_g (and of worker 1's local weights) gives in transformers the logits our
    model gives."""
    mixtral = [*LLAMA, "--num-experts", "4", "--moe-router-topk", "2"]
    cases = (("llama", LLAMA, ["--tensor-model-parallel-size", "2"], "TP 2, PP 1, SP 1, DP 1"),
             ("gpt2", [], [], "TP 1, PP 1, SP 1, DP 1"),
             ("mixtral", mixtral, ["--expert-model-parallel-size", "2"],
              "TP 1, PP 1, SP 1, DP 2, EP 2"))
    launches = []  # the three runs at once: much of a tiny run's time is its start
    for arch, flags, layout, _ in cases:
        launches.append(start(4 if layout else 2, [
            *TINY, "--num-layers", "2", *flags, "--train-iters", "5", "--eval-iters", "0",
            "--diloco-workers", "2", "--diloco-inner-steps", "4", "--diloco-fragments", "2",
            "--diloco-overlap-steps", "1", *layout, "--save", str(tmp_path / arch)],
            tmp_path / f"{arch}.log"))
    try:
        for proc, (arch, *_) in zip(launches, cases):
            assert proc.wait(timeout=400) == 0, (tmp_path / f"{arch}.log").read_text()[-5000:]
    finally:
        for proc in launches:
            if proc.poll() is None:
                proc.kill()
    for arch, flags, layout, written in cases:
        ckpt = tmp_path / arch
        text = cli("inspect", ckpt).stdout
        assert f"written by 2 worker(s) x ({written})" in text
        assert "in flight: none" in text  # the last step merges what is in flight
        info = json.loads(tool("inspect", ckpt, "--json"))
        assert info["iteration"] == 5 and info["run"]["tokens"] == 5 * 4 * SEQ * 2
        out = tmp_path / f"{arch}_hf"
        tool("export-hf", ckpt, out)
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel",
                                         "mixtral": "MixtralForCausalLM"}[arch]]
        assert (out / "model.safetensors").is_file()
        _, _, theta = offline.parameters(str(ckpt), "global")
        assert torch.allclose(_hf_logits(out), _our_logits(megatron_world, flags, theta),
                              atol=1e-5, rtol=0)
        local = tmp_path / f"{arch}_w1"
        tool("export-hf", ckpt, local, "--params", "local", "--worker", "1")
        _, _, w1 = offline.parameters(str(ckpt), "local", 1)
        assert any(not torch.equal(w1[n], theta[n]) for n in theta)  # drifted since a merge
        assert torch.allclose(_hf_logits(local), _our_logits(megatron_world, flags, w1),
                              atol=1e-5, rtol=0)
    bad = cli("export-hf", ckpt, tmp_path / "x", "--params", "local", "--worker", "2",
              check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == \
        "error: --worker 2: the checkpoint has 2 worker(s)"


@pytest.mark.timeout(600)
def test_import_of_a_transformers_model_trains_in_any_layout(tmp_path, megatron_world):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False)
    hf_dir = tmp_path / "hf"
    LlamaForCausalLM(config).save_pretrained(hf_dir)
    ckpt = tmp_path / "imported"
    printed = tool("import-hf", hf_dir, ckpt)
    flags = printed.split("model flags: ", 1)[1].split()
    _, _, params = offline.parameters(str(ckpt), "global")
    assert torch.allclose(_our_logits(megatron_world, flags, params), _hf_logits(hf_dir),
                          atol=1e-5, rtol=0)

    args = [*TINY, "--num-layers", "2", *flags, "--train-iters", "2", "--eval-iters", "0",
            "--load", str(ckpt),
            "--diloco-workers", "2", "--diloco-inner-steps", "2"]
    one = run(2, [*args, "--log-jsonl", str(tmp_path / "tp1.jsonl")])
    assert "resumed from" in one.stderr
    run(4, [*args, "--tensor-model-parallel-size", "2",
            "--log-jsonl", str(tmp_path / "tp2.jsonl")])

    def first_loss(name):
        return [r["train/loss"] for r in read_jsonl(tmp_path / name) if "train/loss" in r][0]

    # Iteration 1's loss is the imported model's on worker 0's first batch, whatever the TP.
    assert first_loss("tp2.jsonl") == pytest.approx(first_loss("tp1.jsonl"), rel=1e-6)
