"""The README's two commands are the set-up a newcomer runs; CI runs the second one.

Running the test command from inside the suite would recurse, so it is checked by name (CI
runs it from a fresh clone). The quick-start command runs for real: it must set up, build its
corpus without downloads, train 2 workers x TP=2 synced by Streaming DiLoCo through the
deepspeed launcher, and leave a summary, TensorBoard scalars and a checkpoint behind.
"""

import json
import re
import subprocess

import pytest

from harness import REPO, env


def readme_commands():
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_opens_with_the_two_commands_and_ci_runs_the_second():
    quickstart, tests = readme_commands()[:2]
    assert quickstart == "bash launch/quickstart.sh"
    assert tests == "bash launch/test.sh"
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith("#")]
    assert ci[-1] == tests


@pytest.mark.timeout(600)
def test_quickstart_trains_two_workers_and_reports(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    command = readme_commands()[0]
    e = env()
    e["QUICKSTART_DIR"] = str(tmp_path)
    proc = subprocess.run(command.split(), cwd=REPO, env=e, capture_output=True, text=True,
                          timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert re.search(r"iteration +100/100 \| loss [0-9.]+ \| lr .* \| tokens/s [0-9,]+ \|",
                     proc.stdout + proc.stderr)

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["iteration"] == 100 and summary["workers"] == 2
    assert summary["tokens"] == 100 * 8 * 128 * 2  # iterations x batch x seq x workers
    assert summary["cross_worker_bytes"] > 0
    # From ln(1024) = 6.9 at initialisation to well below on Python source.
    assert summary["valid_loss"] < 5.0 and summary["test_loss"] < 5.0

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    for tag in ("lm loss", "learning-rate", "grad-norm", "batch-size", "train/tokens_per_s",
                "lm loss validation", "lm loss test", "streaming/drift",
                "streaming/skipped_fragments",
                *(f"streaming/fragment_{p}/{name}" for p in (0, 1) for name in (
                    "outer_grad_norm", "bytes_sent", "bytes_received", "send_to_merge_s",
                    "merge_wait_s", "quant_rel_error", "drift", "skipped"))):
        assert tag in scalars
    # A point with each progress line (--log-interval 10; no --tensorboard-log-interval).
    assert [e.step for e in events.Scalars("lm loss")] == list(range(10, 101, 10))
    assert (tmp_path / "checkpoints" / "iter_0000100" / "worker0" / "metadata.json").is_file()
