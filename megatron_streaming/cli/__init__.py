"""The command line: Megatron-style flags generated from the config and validated in one place
(``arguments``, ``megatron_flags``), and the plotting tool (``plot``)."""
