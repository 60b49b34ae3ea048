"""One worker's training step: the model (``model``, ``attention``, ``ulysses``, ``ladder``,
``weights``), the engine (megatron-core's pipeline schedule inside DeepSpeed ZeRO), the gradient
reductions outside ZeRO (``grads``) and the step timers (``timers``)."""
