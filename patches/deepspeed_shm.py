"""Switch off DeepSpeed's shared-memory collectives on the CPU accelerator (deepspeed 0.19.8).

Why: on the CPU accelerator, ``deepspeed.comm.torch.TorchBackend.__init__`` (reached from
``deepspeed.init_distributed``) calls ``build_shm_op()``, which JIT-compiles the
``deepspeed_shm_comm`` op with g++ (about 50 s on a 2-core host the first time), and then
``shm_comm_op.initialize`` creates a 66 MiB ``/dev/shm/deepspeed_allreduce_buffer_*`` file per
rank that outlives the process. The op only serves ``inference_all_reduce`` (AutoTP inference) on
one node; training collectives go through torch.distributed (gloo) either way.

Fix: replace the module-level ``build_shm_op`` (looked up by ``TorchBackend.__init__`` at call
time) with one returning None, the value upstream itself uses when the op is unavailable; every
collective then falls back to torch.distributed. Must be applied before
``deepspeed.init_distributed``: a backend created earlier has already built its op.

Needed only when DeepSpeed's accelerator is the CPU: the other accelerators have no
``ShareMemCommBuilder`` and upstream's ``build_shm_op`` already returns None there.
"""

import importlib

from ._patch import Patch, deepspeed_on_cpu, is_marked, mark

NAME = "deepspeed_shm"



def _no_shm_op():
    """Stand-in for ``deepspeed.comm.torch.build_shm_op``: no shared-memory op."""
    return None


def install() -> None:
    # importlib, not ``from deepspeed.comm import torch``: the package re-exports the real torch
    # under that name, shadowing the submodule.
    ds_torch_backend = importlib.import_module("deepspeed.comm.torch")
    if is_marked(ds_torch_backend.build_shm_op, NAME):
        return
    ds_torch_backend.build_shm_op = mark(_no_shm_op, NAME)


PATCH = Patch(
    name=NAME,
    package="deepspeed",
    version="0.19.8",
    is_needed=deepspeed_on_cpu,
    install=install,
)
