"""megatron-streaming: Megatron-core GPT workers inside DeepSpeed ZeRO, kept in step across slow
links by Streaming DiLoCo.

The folders, bottom to top; a module imports only from its own folder and the folders below
it (``tests/test_layout.py`` holds the tree to this, docs/DESIGN.md draws it):

``errors`` -> ``config`` -> ``parallel`` -> ``comm`` -> ``worker`` -> ``data`` ->
``streaming`` -> ``checkpoint`` -> ``job`` -> ``cli`` -> ``run`` -> ``plan``

Importing this package imports nothing heavy. It imports ``patches``, whose import hook keeps
torch.compile's machinery out of megatron-core's import (``patches/megatron_jit.py``).
"""

import patches as _patches  # noqa: F401  (before megatron-core's first import)
