"""A user's DeepSpeed JSON (``--deepspeed_config``) merged into the generated one.

The DeepSpeed config is generated from our flags (``engine.deepspeed_config``); Megatron-DeepSpeed
launch scripts also write a JSON of their own. Each of its keys is one of:

* **mapped** to one of our flags (``train_micro_batch_size_per_gpu`` -> ``--micro-batch-size``,
  ``zero_optimization.stage`` -> ``--zero-stage``, ``bf16.enabled`` -> ``--bf16``...): at parse
  time it sets the flag when the flag was not given, and must agree with it when it was;
* **generated** and not to be overridden (``managed_gradient_accumulation``...): refused with
  why, unless equal to what we generate;
* **refused**: asks for what this project does not do (``optimizer``, ``scheduler``,
  ZeRO-Offload...), one line each saying what to use instead;
* anything else (``steps_per_print``, ``wall_clock_breakdown``, ``flops_profiler``,
  ``zero_optimization.reduce_bucket_size``...) tunes DeepSpeed without changing the math and
  passes through.

Problems come back one line each, naming the JSON key, its value, our flag and its value.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Callable, Dict, List, Optional, Tuple

FLAG = "--deepspeed_config"


class DeepSpeedConfigError(ValueError):
    """One line per problem with the user's DeepSpeed JSON."""


@dataclasses.dataclass(frozen=True)
class Mapped:
    flag: str
    field: str  # the config field, found in whichever section holds it
    convert: Callable = lambda value: value  # JSON value -> field value
    also_given: Tuple[str, ...] = ()  # other flags that set the field (Megatron's mapped ones)
    passed_to_deepspeed: bool = True  # False: consumed here (DeepSpeed gets ours instead)


def _zero_stage(value):
    if value not in (0, 1, 2):
        raise DeepSpeedConfigError(f"ZeRO stage {value} is not supported here (0, 1 or 2)")
    return value


MAPPED: Dict[str, Mapped] = {
    "train_micro_batch_size_per_gpu": Mapped("--micro-batch-size", "micro_batch_size"),
    # DeepSpeed's global batch is ours per worker; DeepSpeed itself gets micro x DP (the
    # schedule accumulates), so the key is consumed here.
    "train_batch_size": Mapped("--global-batch-size", "global_batch_size",
                               passed_to_deepspeed=False),
    "gradient_clipping": Mapped("--clip-grad", "clip_grad"),
    "zero_optimization.stage": Mapped("--zero-stage", "zero_stage", _zero_stage,
                                      ("--use-distributed-optimizer",)),
    # Below ZeRO-2 validation turns the flag off (nothing to overlap): DeepSpeed gets ours.
    "zero_optimization.overlap_comm": Mapped("--overlap-grad-reduce", "overlap_grad_reduce",
                                             passed_to_deepspeed=False),
    "bf16.enabled": Mapped("--bf16", "bf16"),
    "bfloat16.enabled": Mapped("--bf16", "bf16"),  # DeepSpeed's older name
    "fp16.enabled": Mapped("--fp16", "fp16"),
    # With fp16 on: DeepSpeed's loss scaler as Megatron's flags (0 = dynamic).
    "fp16.loss_scale": Mapped("--loss-scale", "loss_scale", lambda v: None if v == 0 else v),
    "fp16.initial_scale_power": Mapped("--initial-loss-scale", "initial_loss_scale",
                                       lambda v: float(2 ** v)),
    "fp16.loss_scale_window": Mapped("--loss-scale-window", "loss_scale_window"),
    "fp16.hysteresis": Mapped("--hysteresis", "hysteresis"),
    "fp16.min_loss_scale": Mapped("--min-loss-scale", "min_loss_scale"),
}

# Checked against the step's micro-batch count once the data-parallel size is known.
ACCUMULATION = "gradient_accumulation_steps"

GENERATED_WHY = {
    "managed_gradient_accumulation": "Megatron's schedule runs the micro-batches and DeepSpeed "
    "only steps",
    "zero_allow_untested_optimizer": "the inner optimizer is torch's, which ZeRO calls untested",
}
# Generated as defaults; the user's value wins.
OVERRIDABLE = {"steps_per_print", "wall_clock_breakdown"}

REFUSED = {
    "optimizer": "the inner optimizer comes from --optimizer, --lr, --adam-beta1/2, --adam-eps "
    "and --weight-decay",
    "scheduler": "the learning-rate schedule comes from the --lr-* flags",
}
REFUSED_IF_ON = {
    "zero_optimization.offload_optimizer": "ZeRO-Offload is not supported",
    "zero_optimization.offload_param": "ZeRO-Offload is not supported",
    "amp": "mixed precision comes from --bf16 (or --fp16), not apex amp",
    "torch_autocast": "mixed precision comes from --bf16 (or --fp16), not torch autocast",
    "curriculum_learning": "curriculum learning is not supported",
    "data_efficiency": "DeepSpeed's data-efficiency pipeline is not supported",
}


def load_user_config(path: str) -> dict:
    try:
        with open(path) as f:
            user = json.load(f)
    except (OSError, ValueError) as e:
        raise DeepSpeedConfigError(f"{FLAG} {path}: cannot read it as JSON: {e}") from None
    if not isinstance(user, dict):
        raise DeepSpeedConfigError(f"{FLAG} {path}: expected a JSON object, got "
                                   f"{type(user).__name__}")
    return user


def leaves(tree: dict, prefix: str = "") -> List[Tuple[str, object]]:
    """``{"a": {"b": 1}}`` -> ``[("a.b", 1)]`` (lists and scalars are leaves)."""
    out = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.extend(leaves(value, path + "."))
        else:
            out.append((path, value))
    return out


def _refusal(path: str, value, user: dict) -> Optional[str]:
    top = path.split(".")[0]
    if top in REFUSED:
        return f'"{top}": {REFUSED[top]}; drop the key'
    for key, why in REFUSED_IF_ON.items():
        if path == key or path.startswith(key + "."):
            section = _get(user, key)
            on = section.get("enabled", True) if isinstance(section, dict) else bool(section)
            if isinstance(section, dict) and "device" in section:
                on = section["device"] not in (None, "none")
            if on:
                return f'"{key}": {why}; drop the key'
    return None


def _add_once(lines: List[str], line: str) -> None:
    """A refused section is one line, however many keys it has."""
    if line not in lines:
        lines.append(line)


def _get(tree: dict, path: str):
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _show(value) -> str:
    return json.dumps(value)


def _show_flag(flag: str, value) -> str:
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    return f"{flag} {value if value is not None else '(unset)'}"


def _section_with(cfg, name: str):
    for _, section in cfg.sections():
        if any(f.name == name for f in dataclasses.fields(section)):
            return section
    return None


def _default(section, name: str):
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _fp16_on(cfg, user: dict) -> bool:
    section = _section_with(cfg, "fp16")
    return bool(_get(user, "fp16.enabled")) or bool(section and section.fp16)


def apply_user_config(cfg, given: set) -> Tuple[List[str], List[str]]:
    """Parse time: the JSON's mapped keys set our flags (or must agree with the given ones).
    Returns (notes, problems), one line each."""
    path = cfg.training.deepspeed_config
    if not path:
        return [], []
    try:
        user = load_user_config(path)
    except DeepSpeedConfigError as e:
        return [], [str(e)]
    notes, problems = [], []
    for key, value in leaves(user):
        refusal = _refusal(key, value, user)
        if refusal:
            _add_once(problems, f"{FLAG} {path}: {refusal}")
            continue
        mapped = MAPPED.get(key)
        if mapped is None or (key.startswith("fp16.") and key != "fp16.enabled"
                              and not _fp16_on(cfg, user)):
            continue
        section = _section_with(cfg, mapped.field)
        if section is None:
            if value:
                problems.append(f'{FLAG} {path}: "{key}": {_show(value)} asks for '
                                f"{mapped.flag}, which this pretrain_gpt.py does not have")
            continue
        try:
            want = mapped.convert(value)
        except DeepSpeedConfigError as e:
            problems.append(f'{FLAG} {path}: "{key}": {_show(value)}: {e}')
            continue
        have = getattr(section, mapped.field)
        explicit = mapped.flag in given or bool(given & set(mapped.also_given)) or \
            have != _default(section, mapped.field)
        if not explicit:
            setattr(section, mapped.field, want)
            notes.append(f'{FLAG}: "{key}": {_show(value)} sets {_show_flag(mapped.flag, want)}')
        elif have != want:
            problems.append(f'{FLAG} {path}: "{key}": {_show(value)} vs '
                            f"{_show_flag(mapped.flag, have)}")
    return notes, problems


def check_accumulation(cfg, micro_batches: int, dp: int) -> None:
    """``gradient_accumulation_steps`` is the micro-batch count of a (full) step."""
    path = cfg.training.deepspeed_config
    if not path:
        return
    steps = load_user_config(path).get(ACCUMULATION)
    t = cfg.training
    if steps is not None and steps != micro_batches:
        raise DeepSpeedConfigError(
            f'{FLAG} {path}: "{ACCUMULATION}": {_show(steps)} vs the micro-batches per step: '
            f"--global-batch-size {t.global_batch_size or t.micro_batch_size * dp} / "
            f"(--micro-batch-size {t.micro_batch_size} x data-parallel size {dp}) = "
            f"{micro_batches}")


def merge_user_config(generated: dict, user: dict, cfg) -> dict:
    """The generated DeepSpeed config with the user's pass-through keys added. A key that
    contradicts a generated one raises DeepSpeedConfigError naming both (after
    ``apply_user_config`` the mapped ones agree)."""
    path = cfg.training.deepspeed_config
    merged = copy.deepcopy(generated)
    mine = dict(leaves(generated))
    problems = []
    for key, value in leaves(user):
        mapped = MAPPED.get(key)
        if key == ACCUMULATION or (mapped is not None and not mapped.passed_to_deepspeed):
            continue
        refusal = _refusal(key, value, user)
        if refusal:
            _add_once(problems, f"{FLAG} {path}: {refusal}")
        elif key in mine and key not in OVERRIDABLE and mine[key] != value:
            if mapped is not None:
                section = _section_with(cfg, mapped.field)
                ours = _show_flag(mapped.flag, getattr(section, mapped.field)) if section \
                    else mapped.flag
                problems.append(f'{FLAG} {path}: "{key}": {_show(value)} vs {ours}')
            else:
                why = GENERATED_WHY.get(key.split(".")[0], "generated from this run's flags")
                problems.append(f'{FLAG} {path}: "{key}": {_show(value)}: generated as '
                                f"{_show(mine[key])} ({why}); drop the key")
        else:
            _set(merged, key, value)
    if problems:
        raise DeepSpeedConfigError("\n".join(problems))
    return merged


def _set(tree: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for part in parents:
        if not isinstance(tree.get(part), dict):
            tree[part] = {}
        tree = tree[part]
    tree[last] = value
