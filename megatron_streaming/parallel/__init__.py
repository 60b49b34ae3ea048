"""The rank layout and the process groups inside a worker (``topology``), process start-up
(``distributed``) and launching by the deepspeed launcher, torchrun or a bare srun (``slurm``)."""
