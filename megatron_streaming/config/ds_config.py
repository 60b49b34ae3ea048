"""The DeepSpeed JSON's precision sections, and a user's DeepSpeed JSON (``--deepspeed_config``)
merged into the generated one.

The DeepSpeed config is generated from our flags (``engine.deepspeed_config``; its precision
sections here, ``precision_sections``); Megatron-DeepSpeed launch scripts also write a JSON of
their own. Each of its keys is one of:

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
    "bf16.immediate_grad_update": "BF16_Optimizer (--bf16 at --zero-stage 1) must add each "
    "micro-batch's gradients to its fp32 buffers as they are made, or a pipeline's back-to-back "
    "backwards lose some",
    "data_types": "gradients accumulate over micro-batches in fp32 with --bf16 as in "
    "Megatron-LM, in bf16 with --grad-reduce-in-bf16 or at --zero-stage 0, in fp16 with --fp16",
    "zero_allow_untested_optimizer": "the inner optimizer is torch's, which ZeRO calls untested",
}
# Generated as defaults; the user's value wins.
# What a user's JSON may set against ours: logging only (the throughput timer, off here because
# it synchronizes the device before every micro-batch, times what a user asks it to).
OVERRIDABLE = {"steps_per_print", "wall_clock_breakdown", "timers.throughput.enabled",
               "timers.throughput.synchronized"}

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


def grad_accum_dtype(precision: str, zero_stage: int, reduce_in_bf16: bool = False) -> str:
    """The dtype DeepSpeed accumulates the micro-batches' gradients in (its
    ``data_types.grad_accum_dtype``), Megatron-LM's choice where DeepSpeed can make it.

    Megatron-LM accumulates (and all-reduces) bf16 runs' gradients in fp32 unless
    ``--grad-reduce-in-bf16`` (its ``accumulate_allreduce_grads_in_fp32``, set for bf16 in
    ``megatron/training/arguments.py``), fp16 runs' in fp16. DeepSpeed 0.19.8 accumulates in
    the weights' dtype unless told otherwise, and takes fp32 for bf16 weights only under ZeRO
    (``engine._do_optimizer_sanity_check`` raises NotImplementedError at stage 0): stage 1 then
    runs ``BF16_Optimizer`` (whole fp32 gradient buffers, all-reduced at the step), stage 2 its
    ZeRO optimizer adding each backward's reduced gradients into an fp32 partition. At stage 0
    bf16 gradients stay in bf16, as in Megatron-DeepSpeed (said at start,
    ``cli.arguments``)."""
    if precision != "bf16":
        return precision  # fp32, or fp16 as in Megatron-LM
    return "bf16" if reduce_in_bf16 or zero_stage == 0 else "fp32"


def precision_sections(p, zero_stage: int) -> dict:
    """DeepSpeed's ``fp16`` / ``bf16`` sections from Megatron's flags (``PrecisionConfig``,
    validated): for bf16 the reduction's and the accumulation's dtype (``grad_accum_dtype``);
    for fp16 a static ``--loss-scale``, else dynamic scaling from ``--initial-loss-scale`` (a
    power of two), ``--min-loss-scale``, ``--loss-scale-window`` and ``--hysteresis``."""
    import math

    if p.bf16:
        accumulation = grad_accum_dtype("bf16", zero_stage, p.grad_reduce_in_bf16)
        bf16 = {"enabled": True}
        if accumulation == "fp32" and zero_stage == 1:
            # BF16_Optimizer adds each parameter's bf16 gradient to its fp32 buffer as soon as
            # it is made. By default it does so after each backward, in a callback DeepSpeed
            # 0.19.8 does not queue for the second of two backwards with no forward between
            # them, as a pipeline's cool-down runs them: those micro-batches would be lost.
            bf16["immediate_grad_update"] = True
        # DeepSpeed reduces in the parameters' dtype unless told otherwise; Megatron in fp32.
        return {"bf16": bf16,
                "communication_data_type": "bf16" if p.grad_reduce_in_bf16 else "fp32",
                "data_types": {"grad_accum_dtype": accumulation}}
    if not p.fp16:
        return {}
    accumulation = {"data_types": {"grad_accum_dtype": "fp16"}}  # DeepSpeed's default, said
    if p.loss_scale is not None:
        return {"fp16": {"enabled": True, "loss_scale": p.loss_scale}, **accumulation}
    return {"fp16": {"enabled": True, "loss_scale": 0,  # 0: dynamic
                     "initial_scale_power": int(math.log2(p.initial_loss_scale)),
                     "loss_scale_window": int(p.loss_scale_window),
                     "hysteresis": p.hysteresis,
                     "min_loss_scale": int(p.min_loss_scale)}, **accumulation}


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


# DeepSpeed's names of one dtype (``runtime.config.DtypeEnum``): equal values, whichever is written.
_DTYPE_KEYS = {"data_types.grad_accum_dtype", "communication_data_type"}
_DTYPE_NAMES = {name: canonical for canonical, names in (
    ("fp32", ("fp32", "float32", "float", "torch.float32")),
    ("bf16", ("bf16", "bfloat16", "torch.bfloat16")),
    ("fp16", ("fp16", "float16", "half", "torch.float16"))) for name in names}


def _same(key: str, ours, theirs) -> bool:
    if key in _DTYPE_KEYS and isinstance(theirs, str):
        return _DTYPE_NAMES.get(theirs, theirs) == ours
    return ours == theirs


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
        elif key in mine and key not in OVERRIDABLE and not _same(key, mine[key], value):
            if mapped is not None:
                section = _section_with(cfg, mapped.field)
                ours = _show_flag(mapped.flag, getattr(section, mapped.field)) if section \
                    else mapped.flag
                problems.append(f'{FLAG} {path}: "{key}": {_show(value)} vs {ours}')
            else:
                why = GENERATED_WHY.get(key, GENERATED_WHY.get(
                    key.split(".")[0], "generated from this run's flags"))
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
