"""Host buffers kept beside a GPU, pinned at their exact size: ``--async-save``'s staging
buffer (``checkpoint.background.Staging``) and ``--diloco-offload-outer-state``'s theta_g and
outer momentum (``streaming.sync``).

torch's ``pin_memory=True`` goes through its caching host allocator, which rounds every block
up to the next power of two (``CachingHostAllocatorImpl::allocate`` in
``aten/src/ATen/core/CachingHostAllocator.h``, torch 2.13: ``c10::llvm::PowerOf2Ceil(size)``
below ``pinned_max_round_threshold``, whose default is no threshold) and keeps a freed block
for reuse: a rank's 5 GiB checkpoint staged in 8 GiB of page-locked memory, eight ranks a
node. Its ``pinned_use_cuda_host_register`` setting changes only how a block is page-locked
(``malloc`` and ``cudaHostRegister``), not the rounded size; the threshold is a process-wide
setting read once at start (``PYTORCH_ALLOC_CONF``), a user's to give.

Here a buffer is pageable memory of the exact bytes, page-locked in place with
``cudaHostRegister`` (``torch.cuda.cudart()``, as torch's own checkpoint stager pins its
buffers: ``torch.cuda._pin_memory_utils``) and unregistered when the last tensor over it is
freed: the memory comes from numpy, so that the registration can end with the array, which
every tensor over it keeps alive (``torch.from_numpy``). Several tensors share one buffer,
placed one after another (``layout``). Without a GPU nothing is pinned: plain host memory.
"""

from __future__ import annotations

import logging
import weakref
from typing import List, Optional, Sequence, Tuple

import torch

log = logging.getLogger("megatron_streaming")

ALIGN = 64  # bytes: every tensor of a buffer starts at a multiple (a cache line, any dtype)
HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable (torch.cuda._pin_memory_utils uses it)


def aligned(nbytes: int, align: int = ALIGN) -> int:
    return (nbytes + align - 1) // align * align


def layout(sizes: Sequence[int], align: int = ALIGN) -> Tuple[List[int], int]:
    """Where tensors of ``sizes`` bytes start in one buffer, one after another, each at a
    multiple of ``align``; and the buffer's bytes (the last one's end, aligned)."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += aligned(size, align)
    return offsets, end


def host_buffer(nbytes: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """``nbytes`` of host memory as a uint8 tensor, every page resident: page-locked at
    exactly that size for copies to and from ``device`` when it is a GPU, else pageable
    (faulted in here rather than by the first copy)."""
    if device is None or torch.device(device).type != "cuda" or nbytes == 0:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        buffer.fill_(0)
        return buffer
    import numpy

    array = numpy.empty(nbytes, dtype=numpy.uint8)
    pointer = array.ctypes.data
    # On ``device``: a thread of its own (the staging's) would otherwise make a context on
    # GPU 0. Portable: pinned for every context, as torch's own pinned memory is.
    with torch.cuda.device(device):
        error = torch.cuda.cudart().cudaHostRegister(pointer, nbytes, HOST_REGISTER_PORTABLE)
    if _code(error) != 0:  # the copies still work from pageable memory, at a lower rate
        log.warning("cudaHostRegister of %d bytes of host memory failed (%s): the buffer is "
                    "not pinned, its copies to and from the GPU run at pageable speed",
                    nbytes, error)
        buffer = torch.from_numpy(array)
        buffer.fill_(0)
        return buffer
    # Unregistered before numpy frees the memory (weak references are cleared first). Not at
    # the interpreter's exit: the CUDA context may be gone by then, and exit frees it all.
    weakref.finalize(array, _unregister, pointer).atexit = False
    return torch.from_numpy(array)


def _unregister(pointer: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(pointer)


def _code(error) -> int:
    """cudart's return value as an int (an enum member in some torch builds)."""
    return int(getattr(error, "value", error))


def host_tensors(shapes: Sequence[Tuple[Sequence[int], torch.dtype]],
                 device: Optional[torch.device] = None) -> List[torch.Tensor]:
    """Zero-filled host tensors of ``shapes`` (``(shape, dtype)`` each), views of one
    ``host_buffer`` (pinned at its exact size for ``device`` when that is a GPU)."""
    nbytes = [_numel(shape) * torch.empty(0, dtype=dtype).element_size()
              for shape, dtype in shapes]
    offsets, total = layout(nbytes)
    buffer = host_buffer(total, device)
    buffer.zero_()
    return [buffer[offset:offset + n].view(dtype).view(tuple(shape))
            for (shape, dtype), offset, n in zip(shapes, offsets, nbytes)]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


__all__ = ["ALIGN", "aligned", "host_buffer", "host_tensors", "layout"]
