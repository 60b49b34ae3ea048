"""The public Megatron-LM and Megatron-DeepSpeed GPT/Llama launch scripts (tests/public_scripts.py)
through pretrain_gpt.py, as a user would bring them: only the size flags (layers, hidden, heads,
sequence length, batch, iterations, and the parallel sizes so that the job fits 4 CPU ranks)
and the data paths change.

* every script (its optional branches too) parses, and is refused exactly where we refuse:
  one line per refused flag, nothing else;
* the scaled-down scripts pass validation;
* four of them train for real, three as 2 DiLoCo workers (``--diloco-*`` added), one of
  them Megatron-LM's mixture-of-experts (Mixtral) example;
* the flag table of docs/megatron.md is this file's ``render_table()`` (regenerate it with
  ``UPDATE_FLAG_TABLE=1 .venv/bin/python -m pytest tests/test_public_scripts.py -k table``).
"""

import json
import os
import re

import pytest

from harness import REPO, read_jsonl, run
from megatron_streaming.cli import megatron_flags
from megatron_streaming.cli.arguments import ConfigError, build_parser, parse_args, validate
from public_scripts import SCRIPTS

BY_NAME = {s["name"]: s for s in SCRIPTS}

# What stays refused on this CPU machine, per script, one line per flag (prefixes).
REFUSED = {
    "llama3_8b": ["--fp8-param-gather: FP8 parameters cannot go into DeepSpeed ZeRO"],
    # with its commented-out --load only: a resume here restores both
    "mixtral_8x7b": ["--no-load-optim: a resume restores", "--no-load-rng: a resume restores"],
}
# Refused at validation on a machine without a GPU / Transformer Engine.
REFUSED_ON_CPU = {
    "llama3_8b": ["--fp8-format hybrid"],
}

# Size flags -> the value of the scaled-down job.
SIZES = {
    "--num-layers": "4", "--hidden-size": "64", "--ffn-hidden-size": "176",
    "--num-attention-heads": "4", "--kv-channels": "16", "--num-query-groups": "2",
    "--num-key-value-heads": "2", "--seq-length": "64", "--max-position-embeddings": "64",
    "--micro-batch-size": "2", "--global-batch-size": "4", "--train-iters": "6",
    "--eval-iters": "1", "--eval-interval": "6", "--save-interval": "6", "--exit-interval": "6",
    "--log-interval": "1", "--lr-warmup-iters": "1", "--lr-decay-iters": "6",
    "--vocab-size": "255",
    # Sample- and token-based lengths: 6 iterations of 4 samples of 64 tokens.
    "--train-samples": "24", "--lr-decay-samples": "24", "--lr-warmup-samples": "4",
    "--train-tokens": "1536", "--lr-decay-tokens": "1536", "--lr-warmup-tokens": "256",
}
LAYOUT = {"--tensor-model-parallel-size": 2, "--pipeline-model-parallel-size": 2,
          "--ds-sequence-parallel-size": 2, "--expert-model-parallel-size": 2}


def _value_of(args, flag):
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def scale(args, layout_cap=LAYOUT, extra_sizes=None):
    """The script's argument list with the sizes replaced (``--flag value`` and
    ``--flag=value`` forms) and the parallel sizes capped."""
    sizes = {**SIZES, **{k: str(v) for k, v in (extra_sizes or {}).items()}}
    out, i = [], 0
    while i < len(args):
        a = args[i]
        flag, eq, value = a.partition("=")
        if flag == "--rampup-batch-size":  # three values: START INCREMENT SAMPLES
            out += [flag, "2", "2", "8"]
            i += 4
            continue
        new = None
        if flag in sizes:
            new = sizes[flag]
        elif flag in layout_cap:
            old = value if eq else args[i + 1]
            new = str(min(int(old), layout_cap[flag]))
        if new is None:
            out.append(a)
            i += 1
        elif eq:
            out.append(f"{flag}={new}")
            i += 1
        else:
            out += [flag, new]
            i += 2
    return out


def ds_config_for(script, args):
    """The script's DeepSpeed JSON with the batch keys it computes from the same variables."""
    config = json.loads(json.dumps(script["ds_config"]))
    config["train_batch_size"] = int(_value_of(args, "--global-batch-size"))
    config["train_micro_batch_size_per_gpu"] = int(_value_of(args, "--micro-batch-size"))
    return config


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Real files behind every placeholder: a sentencepiece model and a GPT-2 BPE (built here
    from ../shared/data), an indexed dataset for each, a Hugging Face tokenizer directory."""
    from harness import SHARED_DATA
    from local_tokenizers import gpt2_bpe, hugging_face_dir
    from megatron_streaming.data.__main__ import main as preprocess

    root = tmp_path_factory.mktemp("scripts")
    text = (SHARED_DATA / "tinyshakespeare.txt").read_text(encoding="utf-8")[:120_000]
    corpus = root / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    # One document per line: the scripts' 949,50,1 split needs a test document.
    lines = ["--document-boundary", "line"]
    assert preprocess(["--input", str(corpus), "--output-prefix", str(root / "sp"),
                       "--vocab-size", "255", *lines]) == 0
    gpt2_bpe(root, text.split("\n\n"), 400)
    assert preprocess(["--input", str(corpus), "--output-prefix", str(root / "bpe"),
                       "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                       str(root / "vocab.json"), "--merge-file", str(root / "merges.txt"),
                       *lines]) == 0
    hugging_face_dir(root / "hf", str(root / "vocab.json"), str(root / "merges.txt"))
    return root


def placeholders(script, args, root, run_dir):
    """Placeholders -> files. DATA is the dataset of the script's tokenizer."""
    bpe = "VOCAB" in args or "HF_TOKENIZER" in args
    run_dir.mkdir(parents=True, exist_ok=True)
    ds_path = run_dir / "ds_config.json"
    if script["ds_config"] is not None:
        ds_path.write_text(json.dumps(ds_config_for(script, args)))
    files = {"DATA": str(root / ("bpe" if bpe else "sp")), "VOCAB": str(root / "vocab.json"),
             "MERGES": str(root / "merges.txt"), "TOKENIZER": str(root / "sp.model"),
             "HF_TOKENIZER": str(root / "hf"), "CKPT": str(run_dir / "ckpt"),
             "TB": str(run_dir / "tb"), "CACHE": str(run_dir / "cache"),
             "DS_CONFIG": str(ds_path)}
    out = []
    for a in args:
        flag, eq, value = a.partition("=")
        if eq and value in files:
            out.append(f"{flag}={files[value]}")
        else:
            out.append(files.get(a, a))
    return out


def _refusals(argv):
    try:
        parse_args(argv)
    except ConfigError as e:
        return str(e).splitlines()
    return []


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_script_parses_and_refuses_one_line_per_flag(name, paths, tmp_path):
    script = BY_NAME[name]
    argv = placeholders(script, scale([*script["args"], *script["optional"]]), paths, tmp_path)
    lines = _refusals(argv)
    want = REFUSED.get(name, [])
    assert len(lines) == len(want), lines
    for line, prefix in zip(sorted(lines), sorted(want)):
        assert line.startswith(prefix), (line, prefix)
    assert not any("usage:" in line for line in lines)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_scaled_script_validates(name, paths, tmp_path):
    """The script without its refused flags passes validation at its (capped) layout; a
    Transformer Engine feature is refused on this CPU machine, one line each."""
    script = BY_NAME[name]
    refused = {line.split(":")[0].split()[0] for line in REFUSED.get(name, [])}
    args = [a for a in placeholders(script, scale(script["args"]), paths, tmp_path)]
    args = _drop(args, refused)
    cfg = parse_args(args)
    p = cfg.parallel
    import math

    # a stage's ranks: enough data-parallel ones for the expert-parallel size
    stage = math.lcm(p.tensor_model_parallel_size * p.ds_sequence_parallel_size,
                     p.tensor_model_parallel_size * p.expert_model_parallel_size)
    world = stage * p.pipeline_model_parallel_size
    if name in REFUSED_ON_CPU:
        with pytest.raises(ConfigError) as err:
            validate(cfg, world)
        for prefix in REFUSED_ON_CPU[name]:
            assert prefix in str(err.value)
        return
    validate(cfg, world)


def _drop(args, flags):
    """``args`` without ``flags`` and their values (a value never starts with --)."""
    out, skipping = [], False
    for a in args:
        if a.startswith("--"):
            skipping = a.split("=")[0] in flags
        if not skipping:
            out.append(a)
    return out


# Megatron-LM's ROCm Mixtral example (examples/mixtral/train_mixtral_moe.sh, as stored at
# NVIDIA/Megatron-LM@83f0eba84e6b96a22da37ddab6caf4eb8e39148c) passes --save-interval 500 with
# its --save commented out; Megatron-LM saves only `if args.save and args.save_interval`.
SAVE_INTERVAL_NOTE = "--save-interval {} without --save: nothing is saved"


def test_save_interval_without_save_is_accepted_with_one_note(paths, tmp_path):
    """The Mixtral script with --save-interval and no --save validates: one note, said once
    however often the config is validated, and no interval left to save at."""
    script = BY_NAME["mixtral_8x7b"]
    refused = {line.split(":")[0].split()[0] for line in REFUSED["mixtral_8x7b"]}
    args = _drop(placeholders(script, scale(script["args"]), paths, tmp_path), refused)
    cfg = parse_args([*args, "--save-interval", "500"])
    assert cfg.checkpoint.save is None
    validate(cfg, 2)
    validate(cfg, 2)
    notes = [line for line in cfg.adjustments if line.startswith("--save-interval")]
    assert notes == [SAVE_INTERVAL_NOTE.format(500)]
    assert cfg.checkpoint.save_interval == 0
    with pytest.raises(ConfigError, match="--save-interval must be >= 0, got -1"):
        validate(parse_args([*args, "--save-interval", "-1"]), 2)


DILOCO = ["--diloco-workers", "2", "--diloco-inner-steps", "2", "--diloco-fragments", "2",
          "--diloco-quantize", "fp4"]


@pytest.mark.timeout(900)
def test_four_scripts_train(paths, tmp_path):
    """Megatron-DeepSpeed's Llama-2 script (bf16, --zero-stage 0, its DeepSpeed JSON,
    GPTSentencePieceTokenizer) and its GPT-3 1.3B "rebase" script (fp16 with its loss-scale
    JSON, GPT-2 BPE, --train-samples/--train-tokens, token-based lr, activation checkpointing),
    each as 2 DiLoCo workers of TP=2, learn; Megatron-LM's GPT-3 175B script (fp16 from a
    2**32 loss scale, batch ramp-up, --lr-warmup-fraction) at PP=2 skips its overflowing steps
    as Megatron does; its Mixtral script (two experts over EP=2, alltoall, RMSNorm, GQA) learns
    as 2 DiLoCo workers."""
    runs = {
        "llama2_ds": (4, {"--pipeline-model-parallel-size": 1}, DILOCO),
        "gpt_1.3b_rebase": (4, {}, DILOCO),
        "gpt3_175b": (2, {"--tensor-model-parallel-size": 1}, []),
        # Megatron-LM's Mixtral example: two experts over EP=2 in each of 2 workers, with
        # --save-interval and no --save (as its ROCm example has it): nothing is saved.
        "mixtral_8x7b": (4, {}, [*DILOCO, "--save-interval", "3"]),
    }
    for name, (nproc, layout, extra) in runs.items():
        script = BY_NAME[name]
        args = scale(script["args"], {**LAYOUT, **layout},
                     {"--lr": "3e-3", "--train-iters": "6"})
        argv = [*placeholders(script, args, paths, tmp_path / name), *extra,
                "--data-cache-path", str(tmp_path / "cache")]
        argv = _drop(argv, {"--load"})
        proc = run(nproc, [*argv, "--log-jsonl", str(tmp_path / f"{name}.jsonl")])
        losses = [r["train/loss"] for r in read_jsonl(tmp_path / f"{name}.jsonl")
                  if "train/loss" in r]
        assert len(losses) == 6, (name, losses)
        if name == "mixtral_8x7b":  # the note once per job, no checkpoint anywhere
            note = SAVE_INTERVAL_NOTE.format(3)
            assert (proc.stdout + proc.stderr).count(note) == 1, proc.stderr[-4000:]
            assert "saved checkpoint" not in proc.stdout + proc.stderr
            assert not list((tmp_path / name).rglob("iter_*"))
        if name == "gpt3_175b":
            # --fp16 with Megatron's initial loss scale 2**32: the first steps overflow and
            # are skipped while the scale comes down; --hysteresis 2 spares the first
            # overflow only (refilled when the scale grows again), as Megatron-LM's
            # DynamicGradScaler; the loss stays at its initial value meanwhile.
            records = [r for r in read_jsonl(tmp_path / f"{name}.jsonl") if "train/loss" in r]
            scales = [r["train/loss_scale"] for r in records]
            assert scales == [2.0**(32 - i) for i in range(6)], scales
            assert [r["train/skipped_iterations"] for r in records] == [1, 2, 3, 4, 5, 6]
            assert max(losses) - min(losses) < 0.01, losses
            continue
        assert losses[-1] < losses[0], (name, losses)


# ---- the flag table of docs/megatron.md ------------------------------------------------------

def script_flags():
    """flag -> the scripts passing it (in SCRIPTS order), over args and optional branches."""
    found = {}
    for s in SCRIPTS:
        for a in [*s["args"], *s["optional"]]:
            if a.startswith("--"):
                found.setdefault(a.split("=")[0], [])
                if s["name"] not in found[a.split("=")[0]]:
                    found[a.split("=")[0]].append(s["name"])
    return found


GPU_SECTION_NOTE = "Needs Transformer Engine on a GPU: refused on CPU with one line."


def classify(flag):
    """(outcome, what happens) for one flag."""
    if flag in megatron_flags.BY_FLAG:
        f = megatron_flags.BY_FLAG[flag]
        return f.kind, f.note
    action = build_parser()._option_string_actions.get(flag)
    assert action is not None, f"{flag} is neither ours nor in megatron_flags"
    from megatron_streaming.config import TransformerEngineConfig

    help_text = re.sub(r"\s+", " ", action.help or "").split(" (default")[0]
    if action.dest in TransformerEngineConfig.__dataclass_fields__:
        if "Transformer Engine" not in help_text:
            help_text = f"{help_text} {GPU_SECTION_NOTE}"
        return "works (GPU)", help_text
    return "works", help_text


def render_table():
    short = {s["name"]: i + 1 for i, s in enumerate(SCRIPTS)}
    lines = ["| flag | scripts | here | what happens |", "|---|---|---|---|"]
    for flag, names in sorted(script_flags().items()):
        kind, note = classify(flag)
        used = ",".join(str(short[n]) for n in names)
        lines.append(f"| `{flag}` | {used} | {kind} | {note.replace('|', '/')} |")
    legend = "; ".join(f"{i} = `{s['path']}` ({s['source'].split('@')[0]})"
                       for s, i in ((s, short[s['name']]) for s in SCRIPTS))
    return "Scripts: " + legend + ".\n\n" + "\n".join(lines) + "\n"


BEGIN, END = "<!-- flag-table:begin -->", "<!-- flag-table:end -->"


FLAG_TABLE_DOC = REPO / "docs" / "megatron.md"


def test_megatron_guide_has_the_flag_table():
    guide = FLAG_TABLE_DOC.read_text()
    table = render_table()
    if os.environ.get("UPDATE_FLAG_TABLE"):
        head, _, rest = guide.partition(BEGIN)
        _, _, tail = rest.partition(END)
        guide = f"{head}{BEGIN}\n{table}{END}{tail}"
        FLAG_TABLE_DOC.write_text(guide)
    assert f"{BEGIN}\n{table}{END}" in guide, "regenerate: UPDATE_FLAG_TABLE=1 pytest " \
        "tests/test_public_scripts.py::test_megatron_guide_has_the_flag_table"
    counts = {}
    for flag in script_flags():
        kind = classify(flag)[0].split()[0]
        counts[kind] = counts.get(kind, 0) + 1
    print(counts)
