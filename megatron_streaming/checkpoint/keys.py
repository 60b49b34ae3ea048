"""The names a checkpoint stores its tensors under: one table, for saving, loading, the resume
decisions and the offline tools.

A tensor's key is ``<prefix>.<global parameter name>`` (``tensor``), each of the parameter's
full (TP=1) shape; the prefix says what it holds and whose:

* ``worker<w>.model``: worker w's weights, in the model's dtype;
* ``worker<w>.master``: its fp32 master copy (ZeRO, or --bf16/--fp16 without ZeRO);
* ``worker<w>.optim.<state>``: its inner optimizer's per-element state (AdamW's ``exp_avg``
  and ``exp_avg_sq``, SGD's ``momentum_buffer``);
* ``outer.theta_g``, ``outer.momentum``: the global parameters and the outer momentum, the
  same on every worker, stored once by each worker's part; with eager updates each worker's
  own, worker 0's under these keys (what new workers and the offline tools read) and the
  others' under ``worker<w>.outer.theta_g`` and ``worker<w>.outer.momentum``;
* ``outer.pending``: the averaged outer gradient of an exchange in flight;
* ``worker<w>.outer.own``: eager: the worker's share of its latest send, applied already;
* ``worker<w>.outer.residual``: the worker's error-feedback residual.

Not per parameter: ``rng.rank<r>.<name>``, rank r's random number generators.
"""

from __future__ import annotations

from typing import Optional

MODEL, MASTER = "model", "master"
THETA_G, MOMENTUM, PENDING, OWN, RESIDUAL = "theta_g", "momentum", "pending", "own", "residual"
RNG = "rng"


def worker(w: int, kind: str) -> str:
    """Worker ``w``'s weights (``MODEL``) or fp32 master copy (``MASTER``)."""
    return f"worker{w}.{kind}"


def optimizer(w: int, state: str) -> str:
    """Worker ``w``'s inner optimizer state ``state`` (``exp_avg``, ...)."""
    return f"worker{w}.optim.{state}"


def outer(kind: str, w: Optional[int] = None) -> str:
    """The outer state ``kind``: the job's (``w`` None) or worker ``w``'s own."""
    return f"outer.{kind}" if w is None else f"worker{w}.outer.{kind}"


def tensor(prefix: str, name: str) -> str:
    """The key of parameter ``name``'s tensor of kind ``prefix``."""
    return f"{prefix}.{name}"


def rng(rank: int, name: str) -> str:
    return f"{RNG}.rank{rank}.{name}"


def rng_name(key: str) -> Optional[str]:
    """The generator an ``rng`` key holds (None: not an RNG key)."""
    kind, _, rest = key.partition(".")
    return rest.split(".", 1)[1] if kind == RNG else None
