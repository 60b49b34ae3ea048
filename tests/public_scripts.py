"""The public GPT/Llama pretraining launch scripts of Megatron-LM and Megatron-DeepSpeed, as the
argument lists they hand to ``pretrain_gpt.py`` with their default settings.

Values are as published (sizes included); paths are placeholders that the tests replace:
``DATA`` (an indexed dataset prefix), ``VOCAB`` / ``MERGES`` (GPT-2 BPE files), ``TOKENIZER``
(a SentencePiece model), ``CKPT``, ``TB`` and ``DS_CONFIG`` (the DeepSpeed JSON the script
writes, given as ``ds_config``). ``optional`` holds flags of branches that are off by default
(activation checkpointing, wandb, real data instead of mock data). Launcher flags
(``--nproc_per_node`` ...) are not part of these lists.

Sources:
* NVIDIA/Megatron-LM at 157006d6d9bf4f55c0d4d7dacbd2b65e7bd84dc9;
* microsoft/Megatron-DeepSpeed at f4157bea69f3df8c6cb66f2ebcda66ba03d1288e.
"""

MEGATRON_LM = "NVIDIA/Megatron-LM@157006d6d9bf4f55c0d4d7dacbd2b65e7bd84dc9"
MEGATRON_LM_MIXTRAL = "NVIDIA/Megatron-LM@0a40979ee868697bd66157ab800d213ffff030d8"
MEGATRON_DS = "microsoft/Megatron-DeepSpeed@f4157bea69f3df8c6cb66f2ebcda66ba03d1288e"

_LLAMA_DS_MODEL = [
    "--no-query-key-layer-scaling", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--swiglu",
    "--normalization", "rmsnorm", "--disable-bias-linear"]


def _llama_ds(tp, pp, extra_model=()):
    """Megatron-DeepSpeed's Llama scripts (pretrain_llama*_distributed.sh)."""
    return [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--num-layers", "24", "--hidden-size", "2048", "--ffn-hidden-size", "5504",
        "--num-attention-heads", "16", "--micro-batch-size", "4", "--global-batch-size", "32",
        "--seq-length", "2048", "--max-position-embeddings", "2048", "--train-iters", "250000",
        "--save", "CKPT", "--load", "CKPT", "--data-path", "1", "DATA", "--data-impl", "mmap",
        "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "TOKENIZER",
        "--split", "949,50,1", "--distributed-backend", "nccl", "--lr", "3e-4",
        "--lr-decay-style", "cosine", "--min-lr", "3e-5", "--weight-decay", "0.1",
        "--clip-grad", "1", "--lr-warmup-iters", "2000", "--optimizer", "adam",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--log-interval", "1",
        "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10", "--bf16",
        *_LLAMA_DS_MODEL, *extra_model,
        "--zero-stage=0", "--deepspeed_config=DS_CONFIG", "--deepspeed"]


_LLAMA_DS_CONFIG = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                    "steps_per_print": 1, "zero_optimization": {"stage": 0},
                    "bf16": {"enabled": True}}
_RECOMPUTE_DS = ["--deepspeed-activation-checkpointing", "--recompute-granularity", "full",
                 "--recompute-method", "uniform"]


def _gpt_ds(seq_len, tp, sp, pp, no_pp, zero_stage, extra):
    """Megatron-DeepSpeed's GPT-3 1.3B scripts (rebase/, sequence_parallel/)."""
    train_samples = 300 * 1000000000 * 2 // seq_len
    args = [
        "--override-opt_param-scheduler", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        "--tensor-model-parallel-size", str(tp), *(["--ds-sequence-parallel-size", str(sp)]
                                                   if sp else []),
        "--init-method-std", "0.013", "--lr-decay-tokens", "300000000000",
        "--lr-warmup-tokens", "3000000000", "--micro-batch-size", str(1 if sp else 2),
        "--exit-duration-in-mins", "30000000", "--global-batch-size", str(2 if sp else 512),
        "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
        "--seq-length", str(seq_len), "--max-position-embeddings", str(seq_len),
        "--train-tokens", "300000000000", "--train-samples", str(train_samples),
        "--lr", "2.0e-4", "--min-lr", "1.0e-6", "--lr-decay-style", "cosine",
        "--split", "949,50,1", "--log-interval", "10", "--eval-interval", "100",
        "--eval-iters", "10", "--save-interval", "100", "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--hysteresis", "2", "--num-workers", "0", "--fp16",
        "--seed", "1234", "--load", "CKPT", "--save", "CKPT",
        "--no-async-tensor-model-parallel-allreduce", *extra,
        "--tensorboard-queue-size", "1", "--log-timers-to-tensorboard",
        "--log-batch-size-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--tensorboard-dir", "TB", "--checkpoint-activations",
        "--log-optimizer-states-to-tensorboard",
        "--vocab-file", "VOCAB", "--merge-file", "MERGES", "--data-path", "DATA",
        "--data-impl", "mmap",
        "--deepspeed", "--deepspeed_config", "DS_CONFIG", "--zero-stage", str(zero_stage),
        "--pipeline-model-parallel-size", str(pp)]
    if no_pp:
        args.append("--no-pipeline-parallel")
    return args + ["--deepspeed-activation-checkpointing"]


def _gpt_ds_config(global_batch, micro_batch, zero_stage):
    return {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro_batch,
            "steps_per_print": 10, "zero_optimization": {"stage": zero_stage},
            "gradient_clipping": 1.0, "prescale_gradients": zero_stage == 0,
            "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500,
                     "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 11},
            "wall_clock_breakdown": False}


SCRIPTS = [
    {
        "name": "gpt3_175b",
        "source": MEGATRON_LM, "path": "examples/gpt3/train_gpt3_175b_distributed.sh",
        "args": [
            "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
            "--seq-length", "2048", "--max-position-embeddings", "2048",
            "--attention-backend", "auto",
            "--micro-batch-size", "1", "--global-batch-size", "1536",
            "--rampup-batch-size", "16", "16", "5859375", "--train-iters", "500000",
            "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
            "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
            "--lr-decay-iters", "430000",
            "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
            "--data-path", "DATA", "--vocab-file", "VOCAB", "--merge-file", "MERGES",
            "--split", "949,50,1",
            "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
            "--save", "CKPT", "--load", "CKPT", "--eval-iters", "10", "--tensorboard-dir", "TB"],
        "optional": [],
        "ds_config": None,
    },
    {
        "name": "llama3_8b",
        "source": MEGATRON_LM, "path": "examples/llama/train_llama3_8b_h100_fp8.sh",
        "args": [
            "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096",
            "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
            "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128",
            "--seq-length", "8192", "--max-position-embeddings", "8192",
            "--position-embedding-type", "rope", "--rotary-base", "1000000",
            "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
            "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused",
            "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
            "--micro-batch-size", "1", "--global-batch-size", "128",
            "--train-samples", "1953125000", "--lr-decay-samples", "1949218748",
            "--lr-warmup-samples", "3906252", "--lr", "0.00015", "--min-lr", "0.00001",
            "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
            "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
            "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
            "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc",
            "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
            "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
            "--fp8-amax-compute-algo", "max", "--fp8-param-gather",
            "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
            "--sequence-parallel",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256",
            "--data-cache-path", "CACHE", "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
            "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
            "--num-workers", "1",
            "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100",
            "--save-interval", "1000", "--log-throughput", "--profile",
            "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format",
            "torch_dist", "--distributed-timeout-minutes", "60", "--save", "CKPT",
            "--load", "CKPT", "--tensorboard-dir", "TB"],
        # Real data instead of mock data (the script's 3rd and 4th arguments).
        "optional": ["--data-path", "DATA", "--tokenizer-type", "HuggingFaceTokenizer",
                     "--tokenizer-model", "HF_TOKENIZER"],
        "ds_config": None,
    },
    {
        "name": "llama2_ds",
        "source": MEGATRON_DS, "path": "examples_deepspeed/pretrain_llama2_distributed.sh",
        "args": _llama_ds(2, 2, ["--num-key-value-heads", "4"]),
        "optional": [*_RECOMPUTE_DS, "--checkpoint-activations",
                     "--recompute-granularity", "selective",
                     "--wandb-project", "pretrain-llama2", "--wandb-exp-name", "exp0"],
        "ds_config": _LLAMA_DS_CONFIG,
    },
    {
        "name": "llama_ds",
        "source": MEGATRON_DS, "path": "examples_deepspeed/pretrain_llama_distributed.sh",
        "args": _llama_ds(2, 2),
        "optional": _RECOMPUTE_DS,
        "ds_config": _LLAMA_DS_CONFIG,
    },
    {
        "name": "gpt_1.3b_sequence_parallel_32k",
        "source": MEGATRON_DS,
        "path": "examples_deepspeed/sequence_parallel/ds_pretrain_gpt_1.3B_seq_parallel_32k.sh",
        "args": _gpt_ds(32768, 1, 4, 1, True, 1, ["--use-flash-attn-triton"]),
        "optional": [],
        "ds_config": _gpt_ds_config(2, 1, 1),
    },
    {
        "name": "gpt_1.3b_rebase",
        "source": MEGATRON_DS, "path": "examples_deepspeed/rebase/ds_pretrain_gpt_1.3B.sh",
        "args": _gpt_ds(2048, 2, 0, 1, True, 0, []),
        "optional": [],
        "ds_config": _gpt_ds_config(512, 2, 0),
    },
    {
        "name": "gpt_1.3b_rebase_rope",
        "source": MEGATRON_DS, "path": "examples_deepspeed/rebase/ds_pretrain_gpt_1.3B_rope.sh",
        "args": _gpt_ds(2048, 4, 0, 8, False, 1, ["--use-rotary-position-embeddings",
                                                   "--rotary-percent", "0.25"]),
        "optional": [],
        "ds_config": _gpt_ds_config(512, 2, 1),
    },
    {
        "name": "llama_universal_checkpointing",
        "source": MEGATRON_DS,
        "path": "examples_deepspeed/universal_checkpointing/llama/run_llama_bf16.sh",
        "args": [
            "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--ds-sequence-parallel-size", "1", "--num-layers", "24", "--hidden-size", "2048",
            "--ffn-hidden-size", "5504", "--num-attention-heads", "16", "--micro-batch-size",
            "4", "--global-batch-size", "32", "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--train-iters", "250000", "--save", "CKPT",
            "--load", "CKPT", "--data-path", "DATA", "--data-impl", "mmap",
            "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "TOKENIZER",
            "--split", "949,50,1", "--distributed-backend", "nccl", "--lr", "3e-4",
            "--lr-decay-style", "cosine", "--min-lr", "3e-5", "--weight-decay", "0.1",
            "--clip-grad", "1", "--lr-warmup-iters", "2000", "--optimizer", "adam",
            "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--log-interval", "1",
            "--save-interval", "100", "--eval-interval", "10", "--eval-iters", "40",
            "--exit-interval", "200", "--bf16", *_LLAMA_DS_MODEL, "--tensorboard-dir", "TB",
            "--zero-stage=1", "--deepspeed_config=DS_CONFIG", "--deepspeed"],
        # run_universal_llama_bf16.sh: the same, resuming under another layout.
        "optional": [*_RECOMPUTE_DS, "--universal-checkpoint"],
        "ds_config": {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                      "steps_per_print": 1, "zero_optimization": {"stage": 1},
                      "bf16": {"enabled": True}, "wall_clock_breakdown": False},
    },
    {
        # Megatron-LM's mixture-of-experts example: its MOE_ARGS as written (grouped GEMM
        # commented out there, so optional here). Its LOGGING_ARGS comment out --save and
        # --save-interval line by line: the interval alone is accepted, as Megatron-LM accepts
        # it, and nothing is saved (tests/test_public_scripts.py).
        "name": "mixtral_8x7b",
        "source": MEGATRON_LM_MIXTRAL, "path": "examples/mixtral/train_mixtral_8x7b_distributed.sh",
        "args": [
            "--use-mcore-models", "--disable-bias-linear", "--seq-length", "256",
            "--max-position-embeddings", "2048", "--num-layers", "2", "--hidden-size", "256",
            "--ffn-hidden-size", "896", "--num-attention-heads", "2", "--init-method-std", "0.01",
            "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization", "RMSNorm",
            "--position-embedding-type", "rope", "--swiglu",
            "--untie-embeddings-and-output-weights", "--group-query-attention",
            "--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding",
            "--rotary-base", "1000000",
            "--num-experts", "2", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
            "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
            "--overlap-param-gather", "--overlap-grad-reduce",
            "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "TOKENIZER",
            "--mock-data", "--split", "99990,8,2",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4",
            "--train-iters", "7", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
            "--clip-grad", "1.0",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
            "--sequence-parallel",
            "--eval-iters", "10", "--no-load-optim", "--no-load-rng"],
        "optional": ["--moe-grouped-gemm", "--data-path", "DATA", "--lr-decay-iters", "320000",
                     "--lr-decay-style", "cosine", "--lr-warmup-iters", "500", "--bf16",
                     "--log-interval", "1", "--save-interval", "10000", "--eval-interval",
                     "1000", "--save", "CKPT", "--load", "CKPT", "--tensorboard-dir", "TB",
                     "--wandb-project", "Mixtral", "--wandb-exp-name", "Mixtral_8x7B"],
        "ds_config": None,
    },
]
