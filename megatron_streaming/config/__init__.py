"""What a job is: the configuration dataclasses (``schema``), the DeepSpeed JSON a user brings
(``ds_config``), the pure functions of the flags over the iterations (``schedules``) and what
the model flags count to (``shape``: the padded vocabulary, the parameters)."""

from .schema import (CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig,
                     OptimizerConfig, ParallelConfig, PrecisionConfig, StreamingConfig,
                     TrainingConfig, TransformerEngineConfig, arg, canonical_normalization,
                     flag_name)

__all__ = ["CheckpointConfig", "Config", "DataConfig", "LoggingConfig", "ModelConfig",
           "OptimizerConfig", "ParallelConfig", "PrecisionConfig", "StreamingConfig",
           "TrainingConfig", "TransformerEngineConfig", "arg", "canonical_normalization",
           "flag_name"]
