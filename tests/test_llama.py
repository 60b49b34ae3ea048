"""A Llama-class model trains the same whatever the layout, and under the streaming sync.

The toy Llama: SwiGLU MLP, grouped-query attention (4 query heads sharing 2 key/value
heads), RoPE with Llama 3's base of 500000, RMSNorm with eps 1e-5, untied output layer, no
linear biases, zero-centred norm weights (``--apply-layernorm-1p``, as Megatron-LM's Llama 3
script). TP, PP, Ulysses SP and Ladder residual must reproduce the single-process losses,
and two streaming workers the single-process DiLoCo reference (tests/diloco_reference.py).
The layouts run torch's fused attention (``--attention-backend auto``, and the flag
Megatron-DeepSpeed scripts pass), the single-process run megatron-core's unfused one.
The layouts train on real text: JSON lines of wikitext through a GPT-2 BPE tokenizer built
here (tests/local_tokenizers.py); the streaming case uses mock data, as its reference does.
"""

import pytest

from harness import SHARED_DATA, TINY, train_losses, train_losses_together, with_stand_ins
from local_tokenizers import gpt2_bpe, write_jsonl
from megatron_streaming.cli.arguments import ConfigError, parse_args, validate

LLAMA = ["--swiglu", "--group-query-attention", "--num-query-groups", "2",
         "--position-embedding-type", "rope", "--rotary-base", "500000",
         "--normalization", "rmsnorm", "--norm-epsilon", "1e-5", "--apply-layernorm-1p",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
TP2 = ["--tensor-model-parallel-size", "2"]
ITERS = ["--train-iters", "3", "--eval-iters", "0"]


def _close(got, want):
    assert len(got) == len(want) == 3
    assert got == pytest.approx(want, rel=1e-5, abs=0)
    assert got[-1] < got[0]


@pytest.fixture(scope="module")
def wiki_data(tmp_path_factory):
    """The data path of a Megatron user: JSON lines of wikitext (one line, one document)
    through a GPT-2 BPE tokenizer built here, preprocessed to PREFIX_text_document."""
    from megatron_streaming.data.__main__ import main as preprocess

    root = tmp_path_factory.mktemp("llama_data")
    text = (SHARED_DATA / "wikitext2-valid.txt").read_text(encoding="utf-8")[:80_000]
    lines = [line.strip() for line in text.splitlines() if len(line.strip()) > 20]
    vocab, merges = gpt2_bpe(root, lines, 500)
    tokenizer = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                 "--merge-file", merges]
    assert preprocess(["--input", write_jsonl(root / "wiki.jsonl", lines), "--output-prefix",
                       str(root / "wiki"), "--append-eod", *tokenizer]) == 0
    return ["--data-path", str(root / "wiki_text_document"), "--split", "98,1,1",
            "--data-cache-path", str(root / "cache"), *tokenizer]


@pytest.mark.timeout(600)
def test_llama_layouts_match_single_process(tmp_path, wiki_data):
    """On GPT-2 BPE tokens of JSON-lines wikitext: TP=2 with Megatron sequence parallelism
    (and apex importable, as in NVIDIA's containers: RMSNorm is torch's norm there too), PP=2,
    Ulysses SP=2 and ZeRO-2 over DP=2 with the fused attention against one process with the
    unfused one; Ladder residual at TP=2 against its own single-process run. Each run says
    which attention it runs."""
    args = [*[a for a in TINY if a != "--mock-data"], *wiki_data, *LLAMA, *ITERS]
    ladder = [*args, "--ladder-residual"]
    # Two at a time: a one-rank reference beside a two-rank layout.
    got = train_losses_together({
        "ref": (1, [*args, "--attention-backend", "unfused"]),
        "tp2": (2, [*args, *TP2, "--sequence-parallel", "--use-flash-attn-v2"],
                with_stand_ins("apex"))}, tmp_path)
    assert "core attention: megatron-core's unfused DotProductAttention" in \
        (tmp_path / "ref.log").read_text()
    assert "core attention: torch's scaled_dot_product_attention (--attention-backend flash)" \
        in (tmp_path / "tp2.log").read_text()
    got.update(train_losses_together({"ladder_ref": (1, ladder),
                                      "ladder": (2, [*ladder, *TP2])}, tmp_path))
    for name, extra in (("pp2", ["--pipeline-model-parallel-size", "2"]),
                        ("ulysses_sp2", ["--ds-sequence-parallel-size", "2"]),
                        ("zero2_dp2", ["--zero-stage", "2"])):
        got[name] = train_losses(2, [*args, *extra], tmp_path, name)
    for name in ("tp2", "pp2", "ulysses_sp2", "zero2_dp2"):
        _close(got[name], got["ref"])
    _close(got["ladder"], got["ladder_ref"])


def test_swiglu_fc1_shards_keep_gate_and_up_together():
    """Each TP rank holds its rows of the gate and of the up projection, as megatron-core's
    MLP expects: a plain chunk of [gate; up] would give rank 0 only gate rows."""
    import torch

    from megatron_streaming.worker.weights import tp_shard, tp_unshard

    full = torch.arange(8.0).view(8, 1)  # gate rows 0-3, up rows 4-7
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert tp_shard(name, full, 0, 0, 2, gated=True).view(-1).tolist() == [0, 1, 4, 5]
    assert tp_shard(name, full, 0, 1, 2, gated=True).view(-1).tolist() == [2, 3, 6, 7]
    assert tp_shard(name, full, 0, 1, 2, gated=False).view(-1).tolist() == [4, 5, 6, 7]
    parts = [tp_shard(name, full, 0, r, 4, gated=True) for r in range(4)]
    assert torch.equal(tp_unshard(name, parts, 0, gated=True), full)


def test_swiglu_default_width_is_megatrons():
    cfg = parse_args(["--mock-data", "--hidden-size", "4096", "--swiglu"])
    assert cfg.model.ffn_size() == 10880  # int(4 * 4096 * 2 / 3 / 64) * 64
    assert parse_args(["--mock-data", "--hidden-size", "64"]).model.ffn_size() == 256


@pytest.mark.parametrize("flags, message", [
    (["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2",
      "--group-query-attention", "--num-query-groups", "2"],
     "--num-query-groups (2) must be divisible by --tensor-model-parallel-size (2) x "
     "--ds-sequence-parallel-size (2) = 4"),
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-attention-heads (4) is not divisible by --num-query-groups (3)"),
    (["--tensor-model-parallel-size", "4", "--group-query-attention", "--num-query-groups",
      "2"], "--num-query-groups (2) is not divisible by --tensor-model-parallel-size (4)"),
    (["--rotary-percent", "0"], "--rotary-percent must be in (0, 1], got 0.0"),
])
def test_attention_layouts_that_cannot_split_are_refused(flags, message):
    cfg = parse_args(["--mock-data", "--hidden-size", "64", "--num-attention-heads", "4",
                      *flags])
    with pytest.raises(ConfigError) as err:
        validate(cfg, 4)
    assert message in str(err.value)


def test_num_key_value_heads_turns_grouped_query_attention_on():
    cfg = parse_args(["--mock-data", "--num-attention-heads", "8", "--num-key-value-heads",
                      "2"])
    assert cfg.model.query_groups() == 2
    # Megatron-LM ignores --num-query-groups without --group-query-attention.
    cfg = parse_args(["--mock-data", "--num-attention-heads", "8", "--num-query-groups", "2"])
    assert cfg.model.query_groups() == 8
