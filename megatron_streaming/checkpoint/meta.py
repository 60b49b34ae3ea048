"""The checkpoint's JSON (``checkpoint.json``), built here alone: for a job's save, from every
rank's ``rank_entry`` (``job.JobState``, ``Checkpointer``), and for a checkpoint written by one
process without a job (``offline.write``). ``resume.plan`` reads it back, ``store`` checks the
files it lists.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from .resume import FORMAT_VERSION, architecture


def rank_entry(rank: int, worker: int, *, written: int, prefixes, shapes: dict,
               optimizer_keys: List[str], optimizer_steps: list, loss_scaler: dict,
               rng: List[str], outer: Optional[dict]) -> dict:
    """One rank's facts: what it wrote, its inner optimizer's state names, step counts and
    loss scaler, its RNG names, and its sync's state (``outer``: the sync's ``state_dict``,
    None without a sync)."""
    info = {"rank": rank, "worker": worker, "bytes": written, "prefixes": sorted(prefixes),
            "shapes": shapes, "optimizer_steps": optimizer_steps,
            "optimizer_keys": optimizer_keys, "rng": rng}
    if loss_scaler:
        info["loss_scaler"] = loss_scaler
    if outer is not None:
        info.update(bytes_sent=outer["bytes"][0], bytes_received=outer["bytes"][1],
                    step=outer["step"], merged_early=outer["merged_early"],
                    error_feedback=outer["residual"] is not None)
        info["pending"] = {str(index): {k: e[k] for k in (
            "step", "fragment", "all_finite", "bytes_sent", "bytes_received", "quant_error")}
            for index, e in outer["exchanges"].items()}
    return info


def description(infos: List[dict], *, layout: dict, model_cfg, vocab_size, tokenizer: dict,
                precision: str, optimizer: Optional[str], streaming: dict) -> dict:
    """What the checkpoint holds, from every rank's entry (the tensor keys each stored added
    as ``keys``): layout, model, sync, each worker's optimizer state, the exchanges in flight,
    every key by part, every parameter's stored shape and the ranks' entries."""
    shapes, keys, prefixes, workers, pending, by_part = {}, set(), set(), {}, {}, {}
    for info in infos:
        shapes.update(info.pop("shapes"))
        mine = info.pop("keys")
        keys.update(mine)
        by_part.setdefault(f"worker{info['worker']}", set()).update(mine)
        prefixes.update(info.pop("prefixes"))
        w = info["worker"]
        if w not in workers:
            workers[w] = {"optimizer_keys": info.get("optimizer_keys", []),
                          "optimizer_steps": info.get("optimizer_steps", []),
                          "residuals": info.get("error_feedback", False),
                          "loss_scaler": info.get("loss_scaler", {})}
        for entry in info.get("pending", {}).values():
            p = pending.setdefault(entry["fragment"], {"fragment": entry["fragment"],
                                                       "step": entry["step"],
                                                       "all_finite": True})
            p["all_finite"] = p["all_finite"] and entry["all_finite"]
    numel = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        numel += n
    return {
        "layout": layout,
        "model": {"architecture": architecture(model_cfg),
                  "config": dataclasses.asdict(model_cfg),
                  "vocab_size": vocab_size, "parameter_count": numel},
        "tokenizer": tokenizer, "precision": precision, "optimizer": {"name": optimizer},
        "streaming": streaming,
        "workers": {str(w): v for w, v in sorted(workers.items())},
        "pending": [pending[f] for f in sorted(pending)],
        "merged_early": infos[0].get("merged_early", []),
        "kinds": {"prefixes": sorted(prefixes), "keys": sorted(keys),
                  "keys_by_part": {p: sorted(k) for p, k in sorted(by_part.items())}},
        "params": dict(sorted(shapes.items())),
        "ranks": infos,
    }


def document(iteration: int, run: dict, described: dict, files: dict, **extra) -> dict:
    """The whole JSON: ``described`` (``description``, or a test state's own) with the
    format, the iteration, the run's position (``run``), every file's size and SHA-256, and
    ``extra`` fields (an offline checkpoint's source and model flags)."""
    return {"format_version": FORMAT_VERSION, "iteration": iteration, "run": run,
            **extra, **described, "files": files}
