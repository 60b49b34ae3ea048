"""``python -m megatron_streaming.checkpoint``: look into, export and import checkpoints
(Hugging Face models in and out, Megatron-LM checkpoints out; ``--load`` reads Megatron-LM's
directly).

    inspect CKPT [--json]                     what a checkpoint holds (reads JSON only)
    export-hf CKPT OUT [--params global|local] [--worker W] [--dtype fp32|bf16|fp16]
                                              a Hugging Face model (safetensors + config.json)
    import-hf HF_DIR CKPT                     a checkpoint to --load, from a Hugging Face model
    export-megatron CKPT OUT [--params global|local] [--worker W] [--dtype fp32|bf16|fp16]
                                              a Megatron-LM torch_dist checkpoint (weights)

CKPT is a --save directory (its latest checkpoint) or one of its ``iter_N`` directories.
Errors are one line naming the file or flag; the exit status is 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from .resume import CheckpointError


def describe(directory: str, meta: dict) -> str:
    lay, model, s = meta["layout"], meta["model"], meta["streaming"]
    cfg = model["config"]
    run = meta["run"]
    lines = [f"checkpoint {directory}",
             f"  format: megatron-core dist_checkpointing (torch_dist), version "
             f"{meta['format_version']}"
             + ("; a part per worker" if meta["format_version"] >= 3 else "")
             + (f"; imported from {meta['source']}" if meta.get("source") else ""),
             f"  iteration {run['iteration']}, tokens {run.get('tokens', 0):,}, consumed samples "
             f"{run.get('consumed_samples', 0):,}",
             f"  written by {lay['workers']} worker(s) x (TP {lay['tp']}, PP {lay['pp']}, SP "
             f"{lay['sp']}, DP {lay['dp']}" + (f", EP {lay['ep']}" if lay.get("ep") else "")
             + f"), ZeRO stage {lay['zero_stage']}, world size "
             f"{lay['world_size']}, {meta['precision']}",
             f"  model: {cfg['num_layers']} layers, hidden {cfg['hidden_size']}, "
             f"{cfg['num_attention_heads']} heads ({model['architecture']['--num-query-groups']}"
             f" query groups), ffn {model['architecture']['--ffn-hidden-size']}, "
             f"{cfg['normalization']}, {cfg['position_embedding_type']} positions"
             f"{', SwiGLU' if cfg['swiglu'] else ''}"
             + (f", MoE: {cfg['num_experts']} experts, top-{cfg['moe_router_topk']}"
                if (cfg.get("num_experts") or 1) > 1 else "")
             + f", vocabulary {model['vocab_size']}",
             f"  parameters: {model['parameter_count']:,} (padded vocabulary included)"]
    if meta.get("model_flags"):
        lines.append("  model flags: " + " ".join(meta["model_flags"]))
    if s["enabled"]:
        pending = ", ".join(f"fragment {p['fragment']} (sent after step {p['step']})"
                            for p in meta["pending"]) or "none"
        lines.append(f"  sync: P={s['fragments']} {s['pattern']}, H={s['inner_steps']}, "
                     f"tau={s['overlap_steps']}, {s['quantize']}"
                     f"{', error feedback' if s['error_feedback'] else ''}, outer lr "
                     f"{s['outer_lr']}, momentum {s['outer_momentum']}; in flight: {pending}")
    else:
        lines.append("  sync: off")
    for w, info in meta["workers"].items():
        keys = ", ".join(info["optimizer_keys"]) or "none (fresh at the first step)"
        steps = sorted({x for x in info["optimizer_steps"] if x is not None})
        lines.append(f"  worker {w}: inner optimizer {meta['optimizer']['name'] or '-'}, state "
                     f"{keys}" + (f", step {int(steps[0])}" if steps else ""))
    lines.append("  stored: " + ", ".join(meta["kinds"]["prefixes"]))
    files = meta["files"]
    lines.append(f"  size on disk: {meta['size_bytes'] / 2**20:.1f} MiB in {len(files)} files")
    return "\n".join(lines)


def _inspect(args) -> None:
    from .offline import open_checkpoint

    directory, meta = open_checkpoint(args.checkpoint, verify=False)
    if args.json:
        keep = ("iteration", "run", "layout", "model", "precision", "streaming", "pending",
                "workers", "size_bytes", "source", "model_flags", "optimizer")
        print(json.dumps({"directory": directory, "files": len(meta["files"]),
                          **{k: meta[k] for k in keep if k in meta}}, indent=1))
    else:
        print(describe(directory, meta))


def _export(args) -> None:
    import torch

    from . import hf
    from ..config import ModelConfig
    from .offline import parameters

    if args.worker is not None and args.params != "local":
        raise CheckpointError("--worker applies to --params local only")
    config, vocab_size, params = parameters(args.checkpoint, args.params, args.worker)
    model_cfg = ModelConfig(**config)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    hf.save_hf(model_cfg, params, vocab_size, args.out, dtype=dtype)
    print(f"wrote a {hf.architecture(model_cfg)} Hugging Face model ({args.params} parameters"
          f"{'' if args.params == 'global' else f' of worker {args.worker or 0}'}) to "
          f"{args.out}")


def _import(args) -> None:
    from . import hf
    from ..cli.arguments import parse_args
    from .offline import write

    flags, params = hf.load_hf(args.hf_dir)
    cfg = parse_args([*flags, "--mock-data"])
    vocab = params["embedding.word_embeddings.weight"].shape[0]
    directory = write(args.checkpoint, cfg.model, params, vocab, flags, args.hf_dir)
    print(f"wrote {directory}; train from it with --load {args.checkpoint} and the model "
          f"flags: {' '.join(flags)}")


def _export_megatron(args) -> None:
    import torch

    from .megatron_export import export

    if args.worker is not None and args.params != "local":
        raise CheckpointError("--worker applies to --params local only")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    directory = export(args.checkpoint, args.out, args.params, args.worker, dtype)
    print(f"wrote a Megatron-LM torch_dist checkpoint ({args.params} parameters"
          f"{'' if args.params == 'global' else f' of worker {args.worker or 0}'}) to "
          f"{directory}; Megatron-LM loads it with --load {args.out} and the model's flags "
          "(or --use-checkpoint-args); a weights-only save: no optimizer or RNG state is read")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_streaming.checkpoint",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="what a checkpoint holds (no tensor is loaded)")
    p.add_argument("checkpoint")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_inspect)
    p = sub.add_parser("export-hf", help="write a Hugging Face model")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--params", choices=["global", "local"], default="global",
                   help="the global parameters (default) or one worker's local ones")
    p.add_argument("--worker", type=int, default=None, help="with --params local (default 0)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.set_defaults(func=_export)
    p = sub.add_parser("import-hf", help="a checkpoint from a Hugging Face model")
    p.add_argument("hf_dir")
    p.add_argument("checkpoint", help="the --save/--load directory to write")
    p.set_defaults(func=_import)
    p = sub.add_parser("export-megatron", help="write a Megatron-LM torch_dist checkpoint")
    p.add_argument("checkpoint")
    p.add_argument("out", help="the directory Megatron-LM's --load takes")
    p.add_argument("--params", choices=["global", "local"], default="global",
                   help="the global parameters (default) or one worker's local ones")
    p.add_argument("--worker", type=int, default=None, help="with --params local (default 0)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.set_defaults(func=_export_megatron)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
