"""Let DeepSpeed's CPU accelerator train in fp16 (deepspeed 0.19.8).

Why: ``DeepSpeedEngine._do_sanity_check`` (reached from ``deepspeed.initialize``) raises
"Type fp16 is not supported on your device." when ``get_accelerator().is_fp16_supported()``
is false. ``CPU_Accelerator.is_fp16_supported`` answers whether oneDNN has *fast* fp16
kernels (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: AVX512-FP16 or AMX-FP16), not
whether torch can compute in fp16: torch's CPU kernels run every op of a GPT's forward and
backward in fp16 on any CPU (slower without that hardware). The accelerator's answer is also
read by ``supported_dtypes`` (which then lists float16) and by Muon's optimizer state dtype,
which this project does not use.

Fix: ``CPU_Accelerator.is_fp16_supported`` returns True. Everything else about fp16 (loss
scaling, overflow checks, master weights) stays DeepSpeed's own.

On a CPU with AVX512-FP16 or AMX-FP16 upstream already answers yes and the fix changes
nothing. Needed only when DeepSpeed's accelerator is the CPU; the GPU accelerators answer for their
device themselves.
"""

from ._patch import Patch, deepspeed_on_cpu, is_marked, mark

NAME = "deepspeed_cpu_fp16"



def _fp16_supported(self) -> bool:
    """Stand-in for ``CPU_Accelerator.is_fp16_supported``: torch computes fp16 on any CPU."""
    return True


def install() -> None:
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    if is_marked(CPU_Accelerator.is_fp16_supported, NAME):
        return
    CPU_Accelerator.is_fp16_supported = mark(_fp16_supported, NAME)


PATCH = Patch(
    name=NAME,
    package="deepspeed",
    version="0.19.8",
    is_needed=deepspeed_on_cpu,
    install=install,
)
