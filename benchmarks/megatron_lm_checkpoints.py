"""Checkpoints both ways against Megatron-LM's own code (``megatron/training/checkpointing.py``),
on CPU: a dense Llama and a Mixtral model (``--moe-layer-freq`` 1 and a list).

* out: a short training run here (``pretrain_gpt.py --save``, iteration 2) exported with
  ``export-megatron``, then loaded by Megatron-LM's ``load_checkpoint`` into the model its
  ``gpt_builder`` builds from its own parser's ``args`` of the user's flags, with a plain
  ``--load`` (no ``--no-load-optim`` / ``--no-load-rng`` / ``--finetune``): its
  ``check_checkpoint_args`` runs inside; every tensor is compared with ours. Then again with
  ``--use-checkpoint-args`` and no model flag (Megatron-LM's ``load_args_from_checkpoint``).
* in: Megatron-LM's ``save_checkpoint`` of that model (iteration 3, its RNG state beside the
  weights), then ``--load`` of it here (``megatron_lm.open_checkpoint``, ``check_compatible``
  with the user's flags, ``load_weights``): every tensor compared; and ``--use-checkpoint-args``
  with no model flag gives the same model and tokenizer size.

Needs Megatron-LM's tree (not a package of this project): ``git archive`` of its tag
``core_v0.16.1`` extracted at ``--megatron-lm`` (default /tmp/mlm); without it the script says
so and exits 0. Megatron-LM's side runs in subprocesses with that tree first on PYTHONPATH
(its ``megatron.core`` is the same 0.16.1 as .venv's) and shims for a CPU-only torch: ``six``
(imported by its BERT tokenizer), its batch-invariant GPU kernels (they import triton), its
tracker read (a CUDA all-reduce), its RNG state's CUDA generator, and megatron-core's CUDA
calls in the torch_dist writer (this project's ``patches/megatron_devices.py``).

    .venv/bin/python benchmarks/megatron_lm_checkpoints.py [--megatron-lm /tmp/mlm] [--out DIR]

``--ours DIR`` runs this project's side from another tree (an older commit's ``git archive``),
to see what a change fixed; ``MEGATRON_LOAD_FLAGS`` adds flags to Megatron-LM's loads (e.g.
``--no-load-optim --no-load-rng``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--group-query-attention", "--num-query-groups", "2", "--rotary-base", "500000",
         "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
         "--attention-dropout", "0", "--hidden-dropout", "0"]
MOE = ["--num-layers", "4", "--num-experts", "4", "--moe-router-topk", "2"]
CASES = {"llama": LLAMA, "mixtral_freq1": [*LLAMA, *MOE],
         "mixtral_list": [*LLAMA, *MOE, "--moe-layer-freq", "([1]*1+[0]*1)*2"]}
# Flags of the launch that are not the model's (Megatron-LM's spelling; ours takes them too).
RUN = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
       "--train-iters", "2", "--mock-data"]


# ---- ours ------------------------------------------------------------------------------------

def ours_save(case: str, out: str) -> None:
    """Train 2 iterations here, save, export to Megatron-LM's format; the global parameters
    beside it (params.pt)."""
    import torch

    from megatron_streaming.checkpoint import offline
    from megatron_streaming.checkpoint.__main__ import main

    save = os.path.join(out, "ours")
    ours = os.environ.get("OURS", REPO)
    cmd = [os.path.join(REPO, ".venv", "bin", "torchrun"), "--standalone", "--nproc-per-node",
           "1", os.path.join(ours, "pretrain_gpt.py"), *CASES[case], *RUN, "--save", save,
           "--log-interval", "1", "--eval-iters", "0"]
    subprocess.run(cmd, check=True, cwd=ours, stdout=subprocess.DEVNULL)
    assert main(["export-megatron", save, os.path.join(out, "exported")]) == 0
    _, _, params = offline.parameters(save, "global")
    torch.save({k: v.float() for k, v in params.items()}, os.path.join(out, "params.pt"))


def ours_load(case: str, out: str) -> dict:
    """--load of Megatron-LM's own save here, with the user's flags."""
    import torch

    import patches
    from megatron_streaming.checkpoint import megatron_lm
    from megatron_streaming.checkpoint.resume import architecture
    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.data.inputs import load_run_tokenizer
    from megatron_streaming.parallel import distributed
    from megatron_streaming.parallel.topology import RankLayout, Topology
    from megatron_streaming.worker.model import build_model

    patches.apply()
    distributed.init_distributed("gloo", 5)
    topology = Topology.create(RankLayout(1, moe=True), 0)
    topology.install_into_megatron()
    root = os.path.join(out, "megatron_lm_saved")
    cfg = parse_args([*CASES[case], *RUN, "--load", root])
    vocab = load_run_tokenizer(cfg).vocab_size
    source = megatron_lm.open_checkpoint(root)
    notes = megatron_lm.check_compatible(source, cfg, vocab)
    model = build_model(cfg.model, cfg.parallel, topology, vocab, None, cfg.precision)
    notes += megatron_lm.load_weights(model, source)
    saved = torch.load(os.path.join(out, "megatron_lm_params.pt"))
    ours = dict(model.named_parameters())
    # --use-checkpoint-args with no model flag: the same model and tokenizer.
    taken = parse_args([*RUN, "--load", root, "--use-checkpoint-args"])
    same = architecture(taken.model) == architecture(cfg.model) and \
        load_run_tokenizer(taken).vocab_size == vocab
    return {"iteration": source.iteration, "notes": notes,
            "use_checkpoint_args_same_model": same,
            "names_equal": set(ours) == set(saved),
            "max_abs_diff": max(float((ours[n].detach() - saved[n]).abs().max())
                                for n in saved)}


# ---- Megatron-LM's ---------------------------------------------------------------------------

def _megatron_lm_imports():
    """Megatron-LM's training package on CPU: its GPU-only batch-invariant kernels (triton)
    stubbed before anything imports them, its tracker read without CUDA."""
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    stub = types.ModuleType(name)
    for fn in ("set_batch_invariant_mode", "is_batch_invariant_mode_enabled",
               "disable_batch_invariant_mode", "enable_batch_invariant_mode"):
        setattr(stub, fn, lambda *a, **k: False)
    sys.modules[name] = stub
    import torch
    from megatron.training import checkpointing

    # megatron-core's own CUDA calls in its torch_dist writer and its models: this project's
    # CPU adapter of them (patches/megatron_devices.py), applied to Megatron-LM's tree.
    sys.path.append(REPO)
    from patches import megatron_devices

    megatron_devices.install()

    # Its tracker read takes the max over ranks with a CUDA tensor; a world of one (gloo, on
    # CPU) has its own value as the max.
    read = checkpointing.read_metadata

    def read_metadata(tracker):
        initialized = torch.distributed.is_initialized
        torch.distributed.is_initialized = lambda: False
        try:
            return read(tracker)
        finally:
            torch.distributed.is_initialized = initialized
    checkpointing.read_metadata = read_metadata
    # Its RNG state holds the CUDA generator's; on CPU the CPU generator's stands in.
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()


def _megatron_lm_args(argv, use_checkpoint_args=False):
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.checkpointing import load_args_from_checkpoint

    sys.argv = ["pretrain_gpt.py", *argv, "--transformer-impl", "local", "--ckpt-format",
                "torch_dist", "--no-gradient-accumulation-fusion", "--use-cpu-initialization",
                "--distributed-backend", "gloo", "--no-persist-layer-norm",
                "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion",
                "--no-bias-dropout-fusion", "--no-async-tensor-model-parallel-allreduce"]
    args = parse_args()
    if use_checkpoint_args:
        args, _ = load_args_from_checkpoint(args)
    validate_args(args, {})
    global_vars.set_global_variables(args)  # its tokenizer: the padded vocabulary
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                             rank=0, world_size=1)
        mpu.initialize_model_parallel(1, 1)
    return args


def _megatron_lm_model(args):
    import torch
    from gpt_builders import gpt_builder
    from model_provider import model_provider

    torch.manual_seed(1234)
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(1234) if torch.cuda.is_available() else None
    return model_provider(gpt_builder, pre_process=True, post_process=True)


def megatron_load(case: str, out: str, use_checkpoint_args: bool) -> dict:
    """Megatron-LM's load_checkpoint of our export, a plain --load with the user's flags (or
    --use-checkpoint-args with none of the model's)."""
    import torch
    from megatron.training.checkpointing import load_checkpoint

    load = ["--load", os.path.join(out, "exported")]
    if use_checkpoint_args:
        argv = [*RUN, "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", *load,
                "--use-checkpoint-args"]
    else:
        argv = [*CASES[case], *RUN, *load]
    argv += os.environ.get("MEGATRON_LOAD_FLAGS", "").split()
    args = _megatron_lm_args(argv, use_checkpoint_args)
    model = _megatron_lm_model(args)
    iteration, _ = load_checkpoint([model], None, None)
    ours = torch.load(os.path.join(out, "params.pt"))
    theirs = dict(model.named_parameters())
    return {"iteration": iteration, "names_equal": set(theirs) == set(ours),
            "max_abs_diff": max(float((theirs[n].detach() - ours[n]).abs().max())
                                for n in ours),
            "moe_layer_freq": repr(args.moe_layer_freq), "num_layers": args.num_layers}


def megatron_save(case: str, out: str) -> dict:
    """Megatron-LM's save_checkpoint of the model of the user's flags (random weights)."""
    import torch
    from megatron.training.checkpointing import save_checkpoint

    args = _megatron_lm_args([*CASES[case], *RUN, "--save",
                              os.path.join(out, "megatron_lm_saved"), "--save-interval", "3",
                              "--no-save-optim"])
    model = _megatron_lm_model(args)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    save_checkpoint(3, [model], None, None, 0)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
               os.path.join(out, "megatron_lm_params.pt"))
    return {"saved": sorted(os.listdir(os.path.join(out, "megatron_lm_saved")))}


# ---- the driver --------------------------------------------------------------------------------

def _phase(phase: str, case: str, out: str, mlm: str = None, ours: str = REPO) -> dict:
    env = dict(os.environ, OURS=ours)
    if mlm:
        shims = os.path.join(out, "..", "shims")
        os.makedirs(shims, exist_ok=True)
        with open(os.path.join(shims, "six.py"), "w") as f:
            f.write("PY2, PY3 = False, True\ntext_type, binary_type = str, bytes\n"
                    "string_types, integer_types = (str,), (int,)\n")
        env["PYTHONPATH"] = os.pathsep.join([mlm, shims])
    else:
        env["PYTHONPATH"] = ours
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--phase", phase,
                           "--case", case, "--out", out], env=env, cwd=mlm or ours,
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = [ln[:400] for ln in (proc.stdout + proc.stderr).strip().splitlines()[-3:]]
        return {"failed": proc.returncode, "tail": tail}
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", default="/tmp/mlm")
    p.add_argument("--out", default=None)
    p.add_argument("--ours", default=REPO, help="this project's tree to run our side from")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.phase:
        if a.phase.startswith("megatron"):
            _megatron_lm_imports()
        else:
            sys.path.insert(0, os.environ.get("OURS", REPO))
        result = {"ours_save": lambda: ours_save(a.case, a.out) or {"done": True},
                  "ours_load": lambda: ours_load(a.case, a.out),
                  "megatron_load": lambda: megatron_load(a.case, a.out, False),
                  "megatron_load_checkpoint_args": lambda: megatron_load(a.case, a.out, True),
                  "megatron_save": lambda: megatron_save(a.case, a.out)}[a.phase]()
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if not os.path.isfile(os.path.join(a.megatron_lm, "megatron", "training",
                                       "checkpointing.py")):
        print(f"skipped: no Megatron-LM tree at {a.megatron_lm} (git archive of its tag "
              "core_v0.16.1 extracted there)")
        return 0
    out = a.out or tempfile.mkdtemp(prefix="megatron_lm_checkpoints_")
    failed = False
    for case in CASES:
        directory = os.path.join(out, case)
        os.makedirs(directory, exist_ok=True)
        for phase, mlm in (("ours_save", None), ("megatron_load", a.megatron_lm),
                           ("megatron_load_checkpoint_args", a.megatron_lm),
                           ("megatron_save", a.megatron_lm), ("ours_load", None)):
            result = _phase(phase, case, directory, mlm, os.path.abspath(a.ours))
            failed |= "failed" in result or result.get("max_abs_diff", 0) != 0 or \
                False in (result.get("names_equal"), result.get("use_checkpoint_args_same_model"))
            print(f"{case:14s} {phase:30s} {json.dumps(result)}", flush=True)
    print("all equal" if not failed else "DIFFERENCES (above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
