"""megatron-streaming: Megatron-core GPT workers inside DeepSpeed ZeRO, kept in step across slow
links by Streaming DiLoCo.

Data flow of one rank: ``data`` (text -> tokenizer -> indexed dataset -> batches) ->
``model`` (GPTModel, with ``ulysses`` / ``ladder`` layer kinds) -> ``engine`` (megatron's
pipeline schedule inside DeepSpeed ZeRO) -> ``streaming`` (the sync hooked into the ZeRO step)
-> ``checkpoint`` / ``metrics``. ``topology`` owns every process group; ``train`` ties it
together for ``pretrain_gpt.py``. Importing this package imports nothing heavy.
"""
