"""What every patch module declares, and the helpers they share."""

from dataclasses import dataclass
from typing import Callable, Tuple, Union

# Attribute set on every wrapper a patch installs, holding the patch name: lets a patch tell
# its own wrapper from the upstream original so that installing twice never wraps twice.
_MARKER = "__megatron_streaming_patch__"


@dataclass(frozen=True)
class Patch:
    """One run-time fix to one upstream package, pinned to the release it was verified on."""

    name: str
    """Patch name, as listed by ``patches.apply()`` and accepted by its ``skip``."""
    package: str
    """Distribution name of the patched package (``importlib.metadata`` spelling)."""
    version: Union[str, Tuple[str, ...]]
    """The upstream versions the patch was verified on: a release (``"0.16.1"``) or the
    release series of ``_pinning.TORCH_VERSIONS``, each with its pre-release and local builds
    (``_pinning.require_version``)."""
    is_needed: Callable[[], bool]
    """True when this process would hit the upstream problem (e.g. no CUDA)."""
    install: Callable[[], None]
    """Installs the fix; must be a no-op when the fix is already in place."""


def cuda_unavailable() -> bool:
    """The condition for every CUDA-only fix: on a CUDA host upstream code is left alone."""
    import torch

    return not torch.cuda.is_available()


def deepspeed_on_cpu() -> bool:
    """The condition for the DeepSpeed fixes: its accelerator is the CPU one."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def mark(wrapper: Callable, patch_name: str) -> Callable:
    """Tag ``wrapper`` as installed by ``patch_name``."""
    setattr(wrapper, _MARKER, patch_name)
    return wrapper


def is_marked(obj: object, patch_name: str) -> bool:
    """Whether ``obj`` is a wrapper installed by ``patch_name``."""
    return getattr(obj, _MARKER, None) == patch_name
