"""Agreement at the door: workers launched separately prove they run the same job before any
process group exists.

Each cluster starts its worker with its own command line. Two commands that differ where the
exchange depends on them (``--diloco-inner-steps``, the model's width, the tokenizer, the
layout, a package version) would otherwise meet in collectives that never pair up: a hang until
the timeout, or an abort deep inside gloo. So the first rank of every worker publishes a
fingerprint of everything that must match to the job's rendezvous store (hosted by global rank
0, the store ``init_process_group`` then uses), every rank reads every worker's, and on any
difference every rank of every worker stops at once with the same one line naming each
differing flag and both values.

What is compared (``fingerprint``): the model's architecture (not recompute or dropout, which
change no parameter), its parameter count, precision, every
``--diloco-*`` flag but the worker's own index, its timeout and which parameters it evaluates,
the inner optimizer and schedule, the training length and the seed (the workers read disjoint
samples of one shuffled order, from weights drawn from one seed), the tokenizer (type,
vocabulary size, a digest of its files), and the versions of this package (a digest of its
source), torch, deepspeed and megatron-core. Data paths are not compared: each cluster has its
own filesystem. Each worker's layout (TP, PP, SP, DP, so its number of ranks; ZeRO stage) and
batch (micro and global) travel beside the fingerprint, not in it (``workers.WorkerShape``):
they may differ, and every rank learns every worker's (``agree`` returns them).

A second launch claiming a worker index that another already holds is refused by name. Bytes
through the door are counted (``Door.bytes``).

The join secret (``MEGATRON_STREAMING_AUTH_TOKEN`` in each launch's environment; kept out of
flags, logs and checkpoints): each worker's record carries an HMAC-SHA256 of its claim (worker
index and launch identity) under the secret, and every rank checks every worker's against its
own secret, so a launch without it, or with another, is refused by every worker before any
process group exists. It keeps stray or misconfigured launches out of a job; it is not
encryption: the store and the exchanges travel in the clear, so an attacker on the link can
read them and speak the store's protocol directly. Run the inter-cluster path over a private
link or a VPN (docs/slurm.md, "The network model").
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import fields
from typing import Callable, Dict, List, Optional

from ..config import flag_name
from ..config.shape import parameter_count
from ..errors import ConfigError

log = logging.getLogger("megatron_streaming")

PREFIX = "megatron_streaming/door/"
SECRET_ENV = "MEGATRON_STREAMING_AUTH_TOKEN"
_MODEL_SKIP = {"recompute_granularity", "recompute_method", "recompute_num_layers",
               "recompute_modules", "hidden_dropout", "attention_dropout",
               "attention_backend",
               # how a worker reaches its experts, not what they compute
               "moe_token_dispatcher_type", "moe_grouped_gemm"}
_STREAMING_SKIP = {"diloco_worker_index", "diloco_timeout", "eval_params"}
# The layout and the batch are each worker's own (``workers.WorkerShape``), not compared.
_TRAINING = ("train_iters", "train_samples", "train_tokens", "rampup_batch_size",
             "step_batch_size_schedule", "seed")
_PRECISION = ("fp16", "bf16", "grad_reduce_in_bf16")


def fingerprint(cfg, layout, tokenizer) -> Dict[str, str]:
    """What must be equal on every worker, as ``{label: value}``; a label is the flag's name
    where there is one."""
    out: Dict[str, str] = {}

    def section(obj, names):
        for name in names:
            out[flag_name(name)] = _shown(getattr(obj, name))

    section(cfg.model, [f.name for f in fields(cfg.model) if f.name not in _MODEL_SKIP])
    out["parameters (from the model flags)"] = str(parameter_count(cfg.model, tokenizer.vocab_size))
    section(cfg.precision, _PRECISION)
    section(cfg.streaming, [f.name for f in fields(cfg.streaming)
                            if f.name not in _STREAMING_SKIP])
    section(cfg.optimizer, [f.name for f in fields(cfg.optimizer)])
    section(cfg.training, _TRAINING)
    out.update(tokenizer_fingerprint(cfg.data, tokenizer))
    out.update(versions())
    return out


def _shown(value) -> str:
    """A flag's value as typed: strings bare, the rest as JSON (lists, None -> null)."""
    return value if isinstance(value, str) else json.dumps(value)


def tokenizer_fingerprint(data_cfg, tokenizer) -> Dict[str, str]:
    """Type, vocabulary size and a digest of the files (content, not path: each cluster keeps
    its copy where it likes)."""
    from ..data.tokenizers import TokenizerSpec

    spec = TokenizerSpec.of(data_cfg)
    out = {"--tokenizer-type": spec.kind if spec.tokenizer_type or data_cfg.tokenizer_model or
           data_cfg.vocab_file else "none (ids only, --mock-data)",
           "vocabulary size": str(tokenizer.vocab_size)}
    for name in ("tokenizer_model", "vocab_file", "merge_file"):
        path = getattr(data_cfg, name)
        if path:
            out[flag_name(name) + " (sha256 of its contents)"] = _digest_path(path)
    for name in ("tiktoken_pattern", "tiktoken_num_special_tokens"):
        if spec.kind == "TikTokenizer":
            out[flag_name(name)] = _shown(getattr(data_cfg, name))
    return out


def _digest_path(path: str) -> str:
    """sha256 of a file, or of a directory's files (names and contents); the string itself
    where it names no local path (a hub name)."""
    h = hashlib.sha256()
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for f in sorted(files):
                full = os.path.join(root, f)
                h.update(os.path.relpath(full, path).encode() + b"\0")
                with open(full, "rb") as fh:
                    h.update(fh.read())
    elif os.path.isfile(path):
        with open(path, "rb") as fh:
            h.update(fh.read())
    else:
        return path
    return h.hexdigest()[:16]


def versions() -> Dict[str, str]:
    from importlib.metadata import version

    def base(v: str) -> str:  # 2.13.0+cpu and 2.13.0+cu128 are the same release
        return v.split("+", 1)[0]

    return {"megatron-streaming (sha256 of its source)": source_digest(),
            "torch version": base(version("torch")),
            "deepspeed version": base(version("deepspeed")),
            "megatron-core version": base(version("megatron-core"))}


def source_digest() -> str:
    """The package's and its patches' Python sources: two clusters on different commits of
    this code differ here."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    h = hashlib.sha256()
    for pkg in ("megatron_streaming", "patches"):
        for dirpath, dirs, files in os.walk(os.path.join(root, pkg)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    full = os.path.join(dirpath, f)
                    h.update(os.path.relpath(full, root).encode() + b"\0")
                    with open(full, "rb") as fh:
                        h.update(fh.read())
    return h.hexdigest()[:16]


def differences(records: List[dict], workers=None) -> List[str]:
    """One clause per worker that differs from the first (``workers``: the index of each
    record's worker, default 0, 1, ...): each differing label with both values. The same on
    every rank, since every rank reads the same records."""
    workers = list(workers or range(len(records)))
    ref = records[0]["fingerprint"]
    out = []
    for w, rec in zip(workers[1:], records[1:]):
        mine = rec["fingerprint"]
        diffs = [f"{k} {ref.get(k, '(absent)')} vs {mine.get(k, '(absent)')}"
                 for k in sorted(set(ref) | set(mine)) if ref.get(k) != mine.get(k)]
        if diffs:
            out.append(f"worker {workers[0]} and worker {w} differ: " + "; ".join(diffs))
    return out


def _ranks(shape: Optional[dict]) -> int:
    """A worker's ranks, from its shape (``workers.WorkerShape.settings``)."""
    from .workers import WorkerShape

    return WorkerShape.from_settings(shape or {}).ranks


def _proof(secret: str, key: str, launch: str) -> str:
    """The claim's HMAC under the join secret ("" without one)."""
    if not secret:
        return ""
    return hmac.new(secret.encode(), f"{key}:{launch}".encode(), hashlib.sha256).hexdigest()


def secret_problems(records: List[dict], secret: str, claims=None) -> List[str]:
    """One clause per worker whose claim was not made with this launch's join secret.
    ``claims``: (worker, claim key) of each record (default: worker i's first claim)."""
    out = []
    for (w, key), rec in zip(claims or [(w, f"worker{w}") for w in range(len(records))],
                             records):
        if not hmac.compare_digest(rec.get("proof", ""), _proof(secret, key, rec["launch"])):
            host = rec["launch"].rsplit(":", 1)[0]
            out.append(f"worker {w} ({host}) joined with another join secret than this "
                       f"launch's ({SECRET_ENV}; {'set' if secret else 'unset'} here): refused")
    return out


class Door:
    """One pass through the door on one rank (``agree``); ``bytes`` counts what it sent and
    read. ``secret``: the job's join secret (default: ``MEGATRON_STREAMING_AUTH_TOKEN``)."""

    def __init__(self, store, worker: int, workers: int, rank_in_worker: int,
                 timeout: datetime.timedelta, secret: Optional[str] = None):
        self.store, self.worker, self.workers = store, worker, workers
        self.rank_in_worker, self.timeout = rank_in_worker, timeout
        self.secret = secret if secret is not None else os.environ.get(SECRET_ENV, "")
        self.bytes = 0

    def _get(self, key: str) -> bytes:
        value = self.store.get(PREFIX + key)
        self.bytes += len(key) + len(value)
        return value

    def agree(self, mine: Dict[str, str], shape: Optional[dict] = None) -> List[dict]:
        """Publish (first rank of the worker), read every worker's, raise ConfigError on a
        difference. Waits for workers not yet started up to ``timeout``. Returns every
        worker's ``shape`` (its layout and batch, ``workers.WorkerShape.settings``), in
        worker order."""
        if self.rank_in_worker == 0:
            self._claim(mine, shape=shape)
        # Stop at the first difference: a worker that counts more workers than the others
        # would otherwise wait for one that never comes.
        records, problems = [], []
        for w in range(self.workers):
            records.append(self._wait_for(w))
            problems = secret_problems(records, self.secret) or differences(records)
            if problems:
                break
        # Whoever hosts the store must not take it away before every rank has read.
        read = self.store.add(PREFIX + "read", 1)
        self.bytes += 2 * len(PREFIX + "read")
        if problems:
            if int(os.environ.get("RANK", "0")) == 0:
                expected = sum(_ranks(r.get("shape") or shape) for r in records)
                deadline = time.monotonic() + 15
                while read < expected and time.monotonic() < deadline:
                    time.sleep(0.2)
                    read = self.store.add(PREFIX + "read", 0)
            raise ConfigError("workers launched with different settings (every worker stops "
                              "here): " + " | ".join(problems))
        log.debug("door: %d workers agree (%d bytes)", self.workers, self.bytes)
        return [r.get("shape") or shape for r in records]

    def rejoin(self, mine: Dict[str, str], epoch: int, members,
               holder_gone: Optional[Callable[[], bool]] = None,
               shape: Optional[dict] = None) -> List[dict]:
        """A restarted worker's pass into a running job (membership epoch ``epoch`` without
        it): its claim is the epoch's own, so two launches cannot both rejoin as one worker;
        its fingerprint and join secret are checked against the live ``members``' records.
        ``holder_gone``: whether the launch holding the claim already has gone (its heartbeat
        stopped before it was admitted); then this launch takes the claim over. Returns every
        worker's shape as ``agree`` does (each from its first claim; its own from ``shape``)."""
        claims = [(w, f"worker{w}") for w in sorted(members)]
        records = [json.loads(self._get(key)) for _, key in claims]
        # Checked before claiming, so that a refused launch does not hold the claim.
        problems = secret_problems(records, self.secret, claims) or differences(
            [records[0], {"fingerprint": mine}], [claims[0][0], self.worker])
        if problems:
            raise ConfigError("a worker rejoining the running job differs from it (it "
                              "stops here): " + " | ".join(problems))
        if self.rank_in_worker == 0:
            self._claim(mine, f"worker{self.worker}.rejoin{epoch}", holder_gone, shape)
        return [shape if w == self.worker else json.loads(self._get(f"worker{w}")).get("shape")
                for w in range(self.workers)]

    def first_rank(self, worker: int) -> int:
        """Worker ``worker``'s first global rank in a running job: the ranks of the workers
        before it, from their first claims' shapes."""
        return sum(_ranks(json.loads(self._get(f"worker{w}")).get("shape"))
                   for w in range(worker))

    def _claim(self, mine: Dict[str, str], key: Optional[str] = None,
               holder_gone: Optional[Callable[[], bool]] = None,
               shape: Optional[dict] = None) -> None:
        ident = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        key = key or f"worker{self.worker}"
        record = json.dumps({"launch": ident, "proof": _proof(self.secret, key, ident),
                             "fingerprint": mine, "shape": shape}).encode()
        self.bytes += len(key) + 2 * len(record)
        held = self.store.compare_set(PREFIX + key, "", record)
        if held != record and holder_gone is not None and holder_gone():
            gone = json.loads(held)["launch"].rsplit(":", 1)[0]
            held = self.store.compare_set(PREFIX + key, held, record)
            if held == record:
                log.warning("worker %d: the launch that asked to rejoin before this one (%s) "
                            "is gone; this launch takes its place", self.worker, gone)
        if held != record:
            other = json.loads(held)["launch"].rsplit(":", 1)[0]
            raise ConfigError(f"--diloco-worker-index {self.worker}: another launch "
                              f"({other}) already joined as worker {self.worker}; give each "
                              "cluster its own index in [0, --diloco-workers)")

    def _wait_for(self, worker: int) -> dict:
        key = f"worker{worker}"
        started = time.monotonic()
        deadline = started + self.timeout.total_seconds()
        said, pause = False, 0.02  # the other workers' first ranks start within ms, or late
        while not self.store.check([PREFIX + key]):  # polled: a timed-out wait logs in C++
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"worker {worker} did not arrive within {self.timeout.total_seconds():.0f} "
                    "s (--distributed-timeout-minutes): start its launch with the same "
                    "--master-addr/--master-port and its own --diloco-worker-index")
            if not said and self.rank_in_worker == 0 and time.monotonic() > started + 10:
                log.warning("waiting for worker %d to start (up to %.0f s)", worker,
                            self.timeout.total_seconds())
                said = True
            time.sleep(pause)
            pause = min(0.5, 2 * pause)
        return json.loads(self._get(key))
