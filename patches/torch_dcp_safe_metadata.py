"""Checkpoint metadata is read without running code from the file (the torch series of
``_pinning.TORCH_VERSIONS``).

Why: ``torch.distributed.checkpoint.FileSystemReader.read_metadata`` reads the ``.metadata``
file of a checkpoint with a bare ``pickle.load``, so a replaced ``.metadata`` could run any
code when a checkpoint is loaded (megatron-core's torch_dist format reads it through there).
Here the reader's module gets a ``pickle`` whose ``load`` accepts only the classes that
torch's own checkpoint metadata is made of (its dataclasses and enums, ``torch.Size``, the
dtypes, layouts by name); anything else raises ``pickle.UnpicklingError`` naming the global.

Needed everywhere (CPU or GPU), so ``is_needed`` is always true.
"""

import importlib
import io
import pickle
import types

from ._patch import Patch, is_marked, mark
from ._pinning import TORCH_VERSIONS

NAME = "torch_dcp_safe_metadata"

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem",
        "LoadItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # the checkpoint id some writers record
}


class SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        import torch

        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which "
                                     "is not part of a checkpoint's metadata")


def safe_load(file, **_):
    return SafeUnpickler(file).load()


def safe_loads(data, **_):
    return SafeUnpickler(io.BytesIO(data)).load()


def install() -> None:
    module = importlib.import_module("torch.distributed.checkpoint.filesystem")
    if is_marked(getattr(module.pickle, "load", None), NAME):
        return
    shim = types.ModuleType("pickle")
    shim.__dict__.update({k: v for k, v in vars(pickle).items() if not k.startswith("__")})
    shim.load, shim.loads = mark(safe_load, NAME), mark(safe_loads, NAME)
    module.pickle = shim


PATCH = Patch(
    name=NAME,
    package="torch",
    version=TORCH_VERSIONS,
    is_needed=lambda: True,
    install=install,
)
