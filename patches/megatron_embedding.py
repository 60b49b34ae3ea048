"""Keep the shared embedding on the CPU during PP setup (megatron-core 0.16.1).

Why: with ``share_embeddings_and_output_weights=True`` and pipeline parallelism,
``LanguageModule.setup_embeddings_and_output_layer`` (run from ``GPTModel.__init__``) does
``weight.data = weight.data.cuda()`` on the first and last stages before all-reducing the
embedding over the embedding group, which fails on a CPU-only torch.

Fix: wrap that one method so that ``Tensor.cuda()`` returns the tensor itself while it runs.
The swap is process-wide for the duration of the call (model construction, single thread) and
is undone in ``finally``.
"""

import contextlib
import functools

import torch

from ._patch import Patch, cuda_unavailable, is_marked, mark

NAME = "megatron_embedding"


def _stay_on_cpu(self, *args, **kwargs):
    return self


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    original = torch.Tensor.cuda
    torch.Tensor.cuda = _stay_on_cpu
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def install() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer
    if is_marked(original, NAME):
        return

    @functools.wraps(original)
    def setup_embeddings_and_output_layer(self, *args, **kwargs):
        with _tensor_cuda_is_identity():
            return original(self, *args, **kwargs)

    LanguageModule.setup_embeddings_and_output_layer = mark(setup_embeddings_and_output_layer, NAME)


PATCH = Patch(
    name=NAME,
    package="megatron-core",
    version="0.16.1",
    is_needed=cuda_unavailable,
    install=install,
)
