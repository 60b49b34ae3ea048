"""The DiLoCo scaling-law paper's protocol (arXiv 2503.09799, Tables 3-4) at a size two CPU
cores train: held-out loss of data parallel and of Streaming DiLoCo with M = 1, 2 and 4
workers, at 2.5, 5, 10 and 20 tokens per parameter, on a corpus read once.

    .venv/bin/python benchmarks/protocol.py                   # every phase in order (hours)
    .venv/bin/python benchmarks/protocol.py --phases tune dp  # some phases, in this order
    .venv/bin/python benchmarks/protocol.py --plan            # what is done, what is to run
    .venv/bin/python benchmarks/protocol.py --report          # tables and plot only
    .venv/bin/python benchmarks/protocol.py --rungs 0.1 0.2 --tune-rung 0.1 --lrs 4e-3 \\
        --batches 32 --outer-lrs 0.6 --results /tmp/p --out /tmp/p  # the harness in minutes

The paper's protocol, scaled: a small GPT (6 layers, d 96, 3 heads, seq 256, vocabulary
4096; 1.09M parameters counted as the paper counts them, all of them, embeddings included;
its 35M model is 6 layers, d 512, vocabulary 32k, seq 2048); AdamW (beta2 0.95, weight decay
0.01, clip 1.0), warm-up 5 % of the run and cosine to a tenth, each rung a run of its own with
its schedule scaled to its budget. Data parallel: one worker of 2 ranks, global batch B.
DiLoCo: M workers of B/M each (M=1: data parallel's worker and batch), the same tokens and
global batch; H=30, P=3 fragments, tau=1, alpha 0, outer gradients as FP4 E2M1 (M=1: tau 0 and
no quantization, nothing crosses a wire); the outer optimizer plain averaging (lr 1, no momentum) or Nesterov
momentum 0.9 at an outer lr swept per M. Held-out loss is evaluated every tenth of a run on
the global parameters.

Phases (each chooses from the records of the ones before it, so ``--phases`` may resume any):

* ``tune``: data parallel at the tuning rung (5 tokens per parameter), seed 1: inner lr over
  ``--lrs`` at the middle batch (widened while the best is at an edge), then the other batches
  at the best lr and its neighbour; the pair of least validation loss is held for every
  method and rung.
* ``dp``: data parallel at the top rung, every seed.
* ``outer``: M=2 and 4, plain averaging and Nesterov at each of ``--outer-lrs``, at the tuning
  rung, seed 1: each M keeps the outer lr of least validation loss for every rung.
* ``top``: M=2 and 4, plain and Nesterov at the top rung, every seed.
* ``ladder``: data parallel and M=2 and 4, plain and Nesterov, at the lower rungs, seed 1.
* ``m1``: one worker's outer optimizer (refused until the library runs it): its outer-lr sweep,
  then the top rung with every seed, then the lower rungs.
* ``sparse``: M=2 and 4 under plain averaging at the tuning rung (``--sparse-rung``), seed 1,
  with the dense FP4 exchange and the sparse one at two densities (``--sparse`` picks others
  of ``SPARSE``: its decay, outer lr, H): held-out loss and bytes.
* ``size``: data parallel and M = 2 and 4 under plain averaging at the tuning rung (or
  ``--size-rung``) with the model scaled down and up (``SIZES``, ``--sizes``;
  ``--size-sparse`` adds sparse settings): whether the gap falls with the model's size, as
  the paper's scaling law has it.
* ``ablate``: M=2 under plain averaging at the tuning rung, seed 1, with one change at a time
  (``ABLATIONS``: fp32 outer gradients, tau 0, one fragment, H=15, the inner lr doubled, outer
  lr 1.4, each worker data parallel's batch): which carries the gap.

Corpus: every ``.py`` file of ``.venv`` (sorted by path, one document per distinct content:
duplicates by SHA-1 dropped, empty files too); a file is held out when crc32 of its path
(relative to ``.venv``) is 0 mod 50, in the validation split at 1 mod 50, else trained on. No
choice reads the held-out split: tuning reads the validation split (evaluated once at the end
of a run as Megatron's test split), the tables and curves the held-out one. The vocabulary is
sentencepiece BPE trained on every k-th line of the training split (at most 2M lines, so that
sentencepiece samples none at random). ``corpus.json`` next to the records holds the corpus's
fingerprint (paths and content hashes) and the vocabulary's MD5: a rebuilt corpus that differs
(other packages installed) is refused, as the records were made on the one it names.

Records and resumption: as ``benchmarks/quality.py`` (``quality_common``): every finished run
leaves ``records/KEY.json`` in ``--results`` (keyed by its command and resolved sync settings),
a finished run is never redone; ``protocol.json`` (every run), ``protocol.md`` (the tables)
and ``protocol.png`` (the gap against tokens per parameter, per M).
"""

import argparse
import hashlib
import json
import math
import os
import sys
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.quality import _loss  # noqa: E402
from benchmarks.quality_common import launch, run_key, tokenize_splits  # noqa: E402
from benchmarks.slow_link import bench_lock  # noqa: E402

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 6, 96, 3, 256, 4096
MODEL = ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads",
         str(HEADS), "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ)]
COMMON = [*MODEL, "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--log-interval", "10"]
H = 30
def streaming_flags(tau: int) -> list[str]:
    return ["--diloco-inner-steps", str(H), "--diloco-fragments", "3",
            "--diloco-overlap-steps", str(tau), "--diloco-alpha", "0"]


STREAMING = streaming_flags(1)
PLAIN = ["--diloco-outer-lr", "1", "--diloco-outer-momentum", "0", "--no-diloco-nesterov"]
MOMENTUM = 0.9
SHARDS, HELD_OUT, VALIDATION = 50, 0, 1  # crc32(path) % SHARDS
TOKENIZER_LINES = 2_000_000  # sentencepiece's own cap (input_sentence_size)


def parameters(vocab: int = VOCAB, change=None) -> int:
    """All parameters, as the paper counts them: per layer QKV, projection and a 4x MLP with
    biases and two layer norms (12 d^2 + 13 d), the word embedding (shared with the output
    layer), the learned positions and the final norm; of the model ``change`` names (a size of
    ``SIZES``), else the protocol's."""
    layers, d, _ = model_of(change)
    return layers * (12 * d ** 2 + 13 * d) + vocab * d + SEQ * d + 2 * d


# ---- corpus ---------------------------------------------------------------------------------
def venv_documents(root: Path):
    """(path relative to root, SHA-1, text) of every .py file under ``root``, sorted by path,
    one per distinct content (the first path), empty files left out."""
    seen = set()
    for path in sorted(root.rglob("*.py")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        digest = hashlib.sha1(data).hexdigest()
        if digest in seen or not data.strip():
            continue
        seen.add(digest)
        yield str(path.relative_to(root)), digest, data.decode("utf-8", errors="replace")


def split_of(path: str) -> str:
    shard = zlib.crc32(path.encode()) % SHARDS
    return {HELD_OUT: "heldout", VALIDATION: "validation"}.get(shard, "train")


def train_vocabulary(lines: list[str]) -> bytes:
    """A sentencepiece BPE model of ``VOCAB`` pieces for source code. As the library's
    ``train_tokenizer`` (identity normalization, the newline a piece, byte fallback, the same
    special ids), but: characters a piece each only as far as 99.95 % of the text (the
    library's 100 % gives 3,559 of 4,096 pieces to single characters here, emoji and CJK from
    docstrings; the rarest go to byte fallback instead); a run of spaces may be a piece of its
    own (indentation: one piece for 8 spaces, not 8); no dummy prefix (a line's first word is
    encoded as it was trained: after the newline piece, with no word-boundary mark).
    Deterministic: every line given is read, none sampled."""
    import io

    import sentencepiece

    from megatron_streaming.data import tokenizer as lib

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=VOCAB, model_type="bpe",
        add_dummy_prefix=False, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        user_defined_symbols=[lib.NEWLINE], character_coverage=0.9995, byte_fallback=True,
        pad_id=lib.PAD_ID, unk_id=lib.UNK_ID, bos_id=lib.BOS_ID, eos_id=lib.EOS_ID,
        input_sentence_size=TOKENIZER_LINES, shuffle_input_sentence=False, minloglevel=2)
    return model.getvalue()


def build_corpus(d: Path, root: Path) -> dict:
    splits, fingerprint = {"train": [], "validation": [], "heldout": []}, hashlib.sha1()
    for path, digest, text in venv_documents(root):
        splits[split_of(path)].append(text)
        fingerprint.update(f"{path}\0{digest}\n".encode())
    lines = [line for text in splits["train"] for line in text.splitlines() if line.strip()]
    every = -(-len(lines) // TOKENIZER_LINES)
    model = train_vocabulary(lines[::every])
    (d / "train.model").write_bytes(model)
    tokens = tokenize_splits(d, splits)
    return {"corpus": f"the .py files of {root.name}, deduplicated", "python":
            sys.version.split()[0], "fingerprint": fingerprint.hexdigest(),
            "tokenizer_md5": hashlib.md5(model, usedforsecurity=False).hexdigest(),
            "vocabulary": VOCAB, "tokenizer_lines": len(lines[::every]),
            **{f"{s}_documents": len(docs) for s, docs in splits.items()},
            **{f"{s}_tokens": n for s, n in tokens.items()}}


def corpus_flags(out: Path, results: Path, root: Path) -> tuple[list[str], dict]:
    """Build the corpus once (under ``out``); refuse one that is not the records' corpus."""
    d = out / "data" / "venv"
    meta_path = d / "meta.json"
    if not meta_path.exists():
        d.mkdir(parents=True, exist_ok=True)
        meta_path.write_text(json.dumps(build_corpus(d, root), indent=1))
    meta = json.loads(meta_path.read_text())
    pinned = results / "corpus.json"
    if pinned.exists():
        want = json.loads(pinned.read_text())
        for field in ("fingerprint", "tokenizer_md5"):
            if want[field] != meta[field]:
                raise SystemExit(
                    f"the corpus in {d} ({field} {meta[field]}) is not the one the records in "
                    f"{results} were made on ({want[field]}): the .py files of {root} have "
                    "changed, or sentencepiece trained another vocabulary; give --out and "
                    "--results folders of their own to start a new set of records")
    else:
        results.mkdir(parents=True, exist_ok=True)
        pinned.write_text(json.dumps(meta, indent=1) + "\n")
    d = Path(os.path.relpath(d, REPO))  # runs start in REPO; the run keys hold no absolute path
    return ["--train-data-path", str(d / "train_text_document"),
            "--valid-data-path", str(d / "heldout_text_document"),
            "--test-data-path", str(d / "validation_text_document"),
            "--tokenizer-model", str(d / "train.model"),
            "--data-cache-path", os.path.relpath(out / "cache", REPO)], meta


# ---- runs -----------------------------------------------------------------------------------
# One change at a time to M=2 under plain averaging (phase ``ablate``): which of them carries
# the gap. name -> (what, the flags that replace the protocol's, the factor on the global
# batch: 2 runs each worker at data parallel's batch for half the steps, compared with data
# parallel at that batch).
ABLATIONS = {
    "fp32": ("outer gradients in fp32, no quantization", {"--diloco-quantize": "none"}, 1),
    "tau0": ("tau 0: merged at the send, no inner step lost to the overlap",
             {"--diloco-overlap-steps": "0"}, 1),
    "p1": ("one fragment (plain DiLoCo)", {"--diloco-fragments": "1"}, 1),
    "h15": ("H=15: twice the outer steps", {"--diloco-inner-steps": "15"}, 1),
    "lr2x": ("inner lr doubled (0.008, min 0.0008)", {"--lr": "0.008", "--min-lr": "0.0008"}, 1),
    "olr1.4": ("outer lr 1.4 without momentum (the sqrt(2) two independent updates lose)",
               {"--diloco-outer-lr": "1.4"}, 1),
    "b2x": ("global batch doubled: each worker data parallel's batch, half the steps (against "
            "data parallel at the doubled batch)", {}, 2),
}
# The sparse exchange (phase ``sparse``, M = 2 and 4 under plain averaging at the tuning rung,
# seed 1) at two densities, against the dense FP4 exchange and data parallel: SparseLoCo's
# chunk of 4,096, 2-bit values and accumulator decay 0.95 (the flags' defaults). 64 of 4,096
# is 4,200x fewer bytes than data parallel at H=30 with M=2, 2,100x with M=4 (every payload
# goes to every peer); 32 of 4,096 twice that.
def _sparse(what: str, k: int, extra=None) -> tuple:
    """A ``SPARSE`` entry: k of every 4,096, then ``extra`` flags (in this order: a record's
    key is its command)."""
    return what, {"--diloco-quantize": "sparse", "--diloco-sparse-k": str(k), **(extra or {})}, 1


SPARSE = {
    "sparse64": _sparse("sparse: 64 of every 4,096 (1.6 %), 2-bit values, decay 0.95", 64),
    "sparse32": _sparse("sparse: 32 of every 4,096 (0.8 %), 2-bit values, decay 0.95", 32),
    # Which setting holds the sparse exchange back (``--sparse`` picks these, M=2): what the
    # accumulator keeps, how far each round moves, and the same bytes spent on more rounds.
    "sparse64-decay1": _sparse("sparse 64 of 4,096, accumulator decay 1 (nothing unsent is "
                               "lost)", 64, {"--diloco-sparse-decay": "1"}),
    "sparse64-olr2": _sparse("sparse 64 of 4,096, outer lr 2", 64, {"--diloco-outer-lr": "2"}),
    "sparse64-olr3": _sparse("sparse 64 of 4,096, outer lr 3", 64, {"--diloco-outer-lr": "3"}),
    "sparse32-h15": _sparse("sparse 32 of 4,096 at H=15 (the bytes of 64 at H=30, twice the "
                            "rounds)", 32, {"--diloco-inner-steps": "15"}),
    # Decay 1 was worse than 0.95: does an accumulator that forgets faster do better (what it
    # keeps acts as outer momentum, which costs in this regime)? No: both were worse.
    **{f"sparse64-olr2-decay{d}": _sparse(f"sparse 64 of 4,096, outer lr 2, accumulator decay "
                                          f"{d}", 64, {"--diloco-outer-lr": "2",
                                                       "--diloco-sparse-decay": d})
       for d in ("0.8", "0.5")},
}
SPARSE_DEFAULT = ["sparse64", "sparse32"]
# The model scaled down and up at the tuning rung (phase ``size``): data parallel and M
# workers at each size, the same lr, batch and tokens per parameter, so the gap can be read
# against the model's size as the paper's scaling law reads it (its gap falls with N).
# name -> (layers, hidden, heads): heads of 32 as the protocol's model.
SIZES = {"l4d64": (4, 64, 2), "l8d128": (8, 128, 4)}
CHANGES = {**ABLATIONS, **SPARSE, **{
    name: (f"{layers} layers, d {d}, {heads} heads", {
        "--num-layers": str(layers), "--hidden-size": str(d), "--num-attention-heads": str(heads)},
        1) for name, (layers, d, heads) in SIZES.items()}}


def changes_of(change) -> list[str]:
    """The names a job's change joins with ``+`` (a size, then an ablation or a sparse
    setting: ``l4d64+sparse64-olr2``)."""
    return change.split("+") if change else []


def size_of(change) -> str:
    """The size of ``SIZES`` a job's change names ("" for the protocol's model)."""
    return next((c for c in changes_of(change) if c in SIZES), "")


def model_of(change=None) -> tuple[int, int, int]:
    """(layers, hidden, heads) of a job's model: a size its change names, else the
    protocol's."""
    return SIZES.get(size_of(change), (LAYERS, HIDDEN, HEADS))


def method_name(workers: int, outer_lr, change=None) -> str:
    """``dp``; ``m2-plain`` (outer lr 1, no momentum); ``m2-nesterov0.6``; ``m2-plain+fp32``
    (an ablation); ``dp+l4d64`` (another model size)."""
    base = "dp" if workers == 0 else f"m{workers}-" + (
        "plain" if outer_lr is None else f"nesterov{outer_lr:g}")
    return base + (f"+{change}" if change else "")


def job(rung, workers, outer_lr, lr, batch, seed, change=None) -> dict:
    """One run. ``workers`` 0 is data parallel; ``outer_lr`` None is plain averaging;
    ``change`` one of ``ABLATIONS``. The lrs are kept as their labels print them, so a job and
    its record's label compare equal."""
    lr, outer_lr = float(f"{lr:g}"), None if outer_lr is None else float(f"{outer_lr:g}")
    return {"rung": rung, "workers": workers, "outer_lr": outer_lr, "lr": lr, "batch": batch,
            "seed": seed, "method": method_name(workers, outer_lr, change), "change": change}


def label(j: dict) -> str:
    return f"tpp{j['rung']:g}/{j['method']}/lr{j['lr']:g}/b{j['batch']}/seed{j['seed']}"


def parse_label(text: str) -> dict:
    rung, method, lr, batch, seed = text.split("/")
    workers, outer_lr = 0, None
    method, _, change = method.partition("+")
    if method != "dp":
        m, outer = method.split("-")
        workers = int(m.removeprefix("m"))
        outer_lr = None if outer == "plain" else float(outer.removeprefix("nesterov"))
    return job(float(rung.removeprefix("tpp")), workers, outer_lr,
               float(lr.removeprefix("lr")), int(batch.removeprefix("b")),
               int(seed.removeprefix("seed")), change or None)


def steps_of(rung: float, batch: int, change=None) -> int:
    """Steps of a rung: its tokens over the global batch, a whole number of rounds of H (of
    the model ``change`` names, else the protocol's)."""
    return max(1, round(rung * parameters(change=change) / (batch * SEQ) / H)) * H


def eval_interval(steps: int) -> int:
    """About a tenth of the run, in whole rounds of H: every evaluation of the global
    parameters then comes at the same point of the fragments' cycle, where their lag behind
    the workers' own is the same (and the end, a run's last step, is evaluated anyway)."""
    return max(1, round(steps / 10 / H)) * H


def run_args(j: dict, data: list[str], eval_samples: int) -> tuple[list[str], int]:
    """The command line of a run and its ranks."""
    B, M, steps = j["batch"], j["workers"], steps_of(j["rung"], j["batch"], j.get("change"))
    if M <= 1:  # data parallel's worker of 2 ranks (M=1: its outer optimizer on top)
        flags = ["--diloco-workers", "1", "--global-batch-size", str(B), "--micro-batch-size",
                 str(B // 2)]
        ranks, per_eval_iter = 2, B
    else:
        flags = ["--diloco-workers", str(M), "--global-batch-size", str(B // M),
                 "--micro-batch-size", str(B // M)]
        ranks, per_eval_iter = M, B // M
    if M:
        outer = PLAIN if j["outer_lr"] is None else [
            "--diloco-outer-lr", f"{j['outer_lr']:g}", "--diloco-outer-momentum",
            f"{MOMENTUM:g}", "--diloco-nesterov"]
        # One worker has no exchange to hide: tau 0 (tau 1 would throw away each merged
        # fragment's step in between, the one-worker warning's case), nothing to quantize.
        flags += [*streaming_flags(0 if M == 1 else 1), "--diloco-quantize",
                  "none" if M == 1 else "fp4-e2m1", *outer]
    lr = j["lr"]
    flags += ["--lr", f"{lr:g}", "--min-lr", f"{lr / 10:g}", "--lr-warmup-iters",
              str(max(1, steps // 20)), "--train-iters", str(steps), "--eval-interval",
              str(eval_interval(steps)), "--eval-iters", str(eval_samples // per_eval_iter),
              "--seed", str(j["seed"])]
    flags = [*COMMON, *data, *flags]
    for name in changes_of(j.get("change")):
        for flag, value in CHANGES[name][1].items():
            if flag in flags:
                flags[flags.index(flag) + 1] = value
            else:
                flags += [flag, value]
    return flags, ranks


# ---- choices --------------------------------------------------------------------------------
def _validation(r: dict) -> float:
    v = r["summary"].get("test_loss")  # the validation split, run as Megatron's test split
    return math.inf if v is None else v


def best_dp(rows: list[dict], rung: float):
    """(lr, batch) of data parallel's least validation loss at the tuning rung, seed 1."""
    dps = [r for r in rows if r["method"] == "dp" and r["rung"] == rung and r["seed"] == 1]
    if not dps:
        return None
    r = min(dps, key=_validation)
    return r["lr"], r["batch"]


def best_outer_lr(rows: list[dict], rung: float, workers: int, dp):
    """The Nesterov outer lr of least validation loss for M workers at the tuning rung."""
    runs = [r for r in rows if r["workers"] == workers and r["rung"] == rung and r["seed"] == 1
            and r["outer_lr"] is not None and (r["lr"], r["batch"]) == dp]
    return min(runs, key=_validation)["outer_lr"] if runs else None


# ---- phases ---------------------------------------------------------------------------------
def tune_jobs(opts, rows):
    """Data parallel's inner lr at the middle batch, widened by a factor of 2 while the best
    is at an edge (twice at most); then each other batch at the best lr and at the lr scaled
    with the batch (half the lr for half the batch)."""
    rung, mid = opts.tune_rung, opts.batches[len(opts.batches) // 2]
    done = {(r["lr"], r["batch"]): r for r in rows
            if r["method"] == "dp" and r["rung"] == rung and r["seed"] == 1}
    lrs = sorted(opts.lrs)
    for widened in range(3):
        jobs = [job(rung, 0, None, lr, mid, 1) for lr in lrs]
        if any((lr, mid) not in done for lr in lrs):
            return jobs, False
        best = min(lrs, key=lambda lr: _validation(done[(lr, mid)]))
        if len(lrs) == 1 or lrs[0] < best < lrs[-1] or widened == 2:
            break
        lrs = sorted([*lrs, best / 2 if best == lrs[0] else best * 2])
    for b in opts.batches:
        if b != mid:
            jobs += [job(rung, 0, None, lr, b, 1) for lr in (best, best * b / mid)]
    return jobs, True


def phase_jobs(phase: str, opts, rows):
    """The jobs of a phase, and whether the list is final (False: it depends on runs of its
    own still to finish, e.g. the tuning's second stage)."""
    top, rung = max(opts.rungs), opts.tune_rung
    if phase == "tune":
        return tune_jobs(opts, rows)
    dp = best_dp(rows, rung)
    if dp is None:
        raise SystemExit(f"phase {phase}: no data parallel run at the tuning rung {rung:g} "
                         "yet (phase tune)")
    lower = [x for x in opts.rungs if x != top]
    if phase == "dp":
        return [job(top, 0, None, *dp, s) for s in opts.seeds], True
    if phase == "ablate":
        return [job(rung, 2, None, dp[0], dp[1] * factor, 1, change)
                for change, (_, _, factor) in ABLATIONS.items()], True
    if phase == "sparse":  # with the dense exchange's run beside each (phase outer has it)
        at = opts.sparse_rung or rung
        return [job(at, m, None, *dp, seed, change) for seed in opts.sparse_seeds
                for m in opts.workers if m > 1 for change in (None, *opts.sparse)], True
    if phase == "size":  # the protocol's own model is the rows without a size
        ms = [m for m in opts.workers if m > 1]
        return [job(opts.size_rung or rung, m, None, *dp, seed, "+".join([size, *extra]))
                for seed in opts.size_seeds for size in opts.sizes
                for m, extra in [(0, []), *[(m, []) for m in ms],
                                 *[(m, [x]) for m in ms for x in opts.size_sparse]]], True
    if phase in ("outer", "m1-outer"):
        ms = [1] if phase == "m1-outer" else [m for m in opts.workers if m > 1]
        return [job(rung, m, olr, *dp, 1) for m in ms for olr in (None, *opts.outer_lrs)], True
    best = {m: best_outer_lr(rows, rung, m, dp) for m in opts.workers}
    ms = [1] if phase.startswith("m1") else [m for m in opts.workers if m > 1]
    missing = [m for m in ms if best[m] is None]
    if missing:
        raise SystemExit(f"phase {phase}: no outer-lr sweep for M={missing} at the tuning "
                         "rung yet (phase outer / m1)")
    if phase in ("top", "m1-top"):
        return [job(top, m, olr, *dp, s) for s in opts.seeds for m in ms
                for olr in (None, best[m])], True  # the default, plain averaging, first
    if phase in ("ladder", "m1-ladder"):
        return [job(x, m, olr, *dp, 1) for x in lower for m in [0, *ms]
                for olr in ((None,) if m == 0 else (best[m], None))], True
    raise SystemExit(f"--phases: unknown phase {phase!r}")


PHASES = ["tune", "dp", "outer", "top", "ladder", "m1", "ablate", "sparse", "size"]
M1_PHASES = ["m1-outer", "m1-top", "m1-ladder"]


def one_worker_outer_ready() -> bool:
    """Whether ``--diloco-workers 1`` with outer flags runs an outer optimizer (before it
    did, it was plain training, silently)."""
    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.streaming.settings import enabled

    return enabled(parse_args(["--mock-data", "--diloco-workers", "1", *STREAMING]))


def run_phases(opts, data: list[str], results: Path, out: Path) -> list[str]:
    """Run the phases in order, each job once (a finished one is read from its record);
    returns the labels of the runs that failed (the others go on)."""
    phases = [p for name in opts.phases for p in (M1_PHASES if name == "m1" else [name])]
    if any(p.startswith("m1") for p in phases) and not one_worker_outer_ready():
        raise SystemExit("phase m1: --diloco-workers 1 with outer flags is still plain "
                         "training here; run it once the library runs one worker's outer "
                         "optimizer")
    failed, started, ran = [], time.perf_counter(), 0
    for phase in phases:
        while True:
            jobs, final = phase_jobs(phase, opts, recorded_rows(results / "records"))
            ran_before = ran
            for i, j in enumerate(jobs, 1):
                args, ranks = run_args(j, data, opts.eval_samples)
                if (results / "records" / f"{run_key(args)}.json").exists() or \
                        label(j) in failed:
                    continue
                try:
                    with bench_lock(opts.lock):  # others' runs interleave
                        t0 = time.perf_counter()
                        r = launch(args, out, results / "records", label(j), nproc=ranks)
                except RuntimeError as err:
                    failed.append(label(j))
                    print(f"{phase} [{i}/{len(jobs)}] {label(j)}: FAILED: {err}", flush=True)
                    continue
                ran += 1
                s = r["summary"]
                print(f"{phase} [{i}/{len(jobs)}] {label(j)}: held-out "
                      f"{_loss(s['valid_loss'] or math.inf, 4)}, validation "
                      f"{_loss(_validation(r), 4)} ({time.perf_counter() - t0:.0f} s; "
                      f"{ran} runs in {(time.perf_counter() - started) / 60:.0f} min)",
                      flush=True)
            if final:
                break
            if ran == ran_before:  # its next runs are chosen from runs that failed
                print(f"{phase}: stops short, its next runs wait on failed ones", flush=True)
                break
    return failed


def recorded_rows(records: Path) -> list[dict]:
    """Every finished run whose key still matches its command (else it ran under library
    defaults that have changed since: history, not today's result)."""
    rows = []
    for path in sorted(records.glob("*.json")):
        r = json.loads(path.read_text())
        if run_key(r["args"]) == path.stem:
            rows.append({**parse_label(r["label"]), "key": path.stem, "summary": r["summary"],
                         "held_out": r["held_out"]})
    return rows


def plan_text(opts, results: Path, data: list[str]) -> str:
    """Each phase's runs: done, or to run (with the ranks and steps)."""
    rows, lines = recorded_rows(results / "records"), []
    for phase in [p for n in opts.phases for p in (M1_PHASES if n == "m1" else [n])]:
        try:
            jobs, final = phase_jobs(phase, opts, rows)
        except SystemExit as why:
            lines.append(f"{phase}: waits ({why})")
            continue
        lines.append(f"{phase}:" + ("" if final else " (more once these have run)"))
        for j in jobs:
            args, ranks = run_args(j, data, opts.eval_samples)
            done = (results / "records" / f"{run_key(args)}.json").exists()
            lines.append(f"  {'done' if done else 'to run'}  {label(j)}  ({ranks} ranks, "
                         f"{steps_of(j['rung'], j['batch'], j['change'])} steps)")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phases", nargs="+", default=PHASES, choices=[*PHASES, *M1_PHASES])
    ap.add_argument("--rungs", nargs="+", type=float, default=[2.5, 5, 10, 20],
                    help="tokens per parameter, a run each; the largest is the top rung")
    ap.add_argument("--tune-rung", type=float, default=5,
                    help="the rung of both sweeps (data parallel's lr and batch, the outer lr)")
    ap.add_argument("--lrs", nargs="+", type=float, default=[2e-3, 4e-3, 8e-3],
                    help="data parallel's inner peak lrs at the middle batch")
    ap.add_argument("--batches", nargs="+", type=int, default=[16, 32, 64],
                    help="global batches (sequences of 256) of the tuning; multiples of 4")
    ap.add_argument("--outer-lrs", nargs="+", type=float, default=[0.4, 0.6, 0.8, 1.0],
                    help=f"Nesterov (momentum {MOMENTUM:g}) outer lrs swept per M")
    ap.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4], choices=[1, 2, 4])
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2],
                    help="seeds of the top rung (the lower rungs: seed 1)")
    ap.add_argument("--eval-samples", type=int, default=256,
                    help="held-out (and validation) sequences per evaluation, every method")
    ap.add_argument("--venv", default=str(REPO / ".venv"), help="where the corpus is read")
    ap.add_argument("--out", default=str(REPO / "runs" / "protocol"),
                    help="scratch: the corpus, data caches, full logs")
    ap.add_argument("--results", default=str(REPO / "docs" / "results" / "protocol"),
                    help="records/KEY.json per finished run, corpus.json, protocol.json/.md/.png")
    ap.add_argument("--lock", help="a file every run holds an exclusive flock on while it "
                    "trains (e.g. /tmp/cpu.lock: one run at a time on the machine, others' "
                    "work between runs)")
    ap.add_argument("--sparse", nargs="+", default=SPARSE_DEFAULT, choices=list(SPARSE),
                    help="phase sparse: which settings of the sparse exchange (SPARSE)")
    ap.add_argument("--sparse-seeds", nargs="+", type=int, default=[1],
                    help="phase sparse: its seeds")
    ap.add_argument("--sparse-rung", type=float,
                    help="phase sparse: its tokens per parameter (default: the tuning rung)")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES),
                    help="phase size: the model sizes beside the protocol's (SIZES)")
    ap.add_argument("--size-seeds", nargs="+", type=int, default=[1],
                    help="phase size: its seeds")
    ap.add_argument("--size-rung", type=float,
                    help="phase size: its tokens per parameter (default: the tuning rung)")
    ap.add_argument("--size-sparse", nargs="+", default=[], choices=list(SPARSE),
                    help="phase size: sparse settings run at each size beside the dense one")
    ap.add_argument("--plan", action="store_true", help="run nothing: list each phase's runs")
    ap.add_argument("--report", action="store_true", help="run nothing: tabulate the records")
    opts = ap.parse_args()
    for b in opts.batches:
        if b % 4 or opts.eval_samples % (b // 4):
            raise SystemExit(f"--batches {b}: must split into 4 workers' batches that divide "
                             f"--eval-samples {opts.eval_samples}")
    if opts.tune_rung not in opts.rungs:
        raise SystemExit(f"--tune-rung {opts.tune_rung:g}: not one of --rungs")
    out, results = Path(opts.out), Path(opts.results)
    out.mkdir(parents=True, exist_ok=True)
    data, meta = corpus_flags(out, results, Path(opts.venv))
    read = max(opts.rungs) * parameters() / meta["train_tokens"]
    if read > 1:
        print(f"note: the top rung reads the training split {read:.2f} times", flush=True)
    if opts.plan:
        print(plan_text(opts, results, data))
        return
    from benchmarks.protocol_report import report

    failed = [] if opts.report else run_phases(opts, data, results, out)
    print(report(opts, results, meta))
    if failed:
        raise SystemExit(f"{len(failed)} runs failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
