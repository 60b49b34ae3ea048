"""The run of one rank: set-up, the training loop, evaluation, checkpoints, failure and the
summary (``train``), and what it reports (``metrics``, ``quiet``)."""
