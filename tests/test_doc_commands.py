"""Every command the README and the guides show, as a newcomer would copy it.

* Every ``pretrain_gpt.py`` line (through a launcher, ``launch/slurm.sh`` or ``srun``) parses:
  the flags it shows exist and take the values shown (``...`` and ``<placeholders>`` dropped,
  ``--mock-data`` added where it names no data).
* Every complete one (nothing elided) that runs several workers syncs at least three times
  over its run, with the H the defaults choose where it types none.
* The complete ones a CPU runs (mock data, nothing outside the repository: the README's two
  clusters on one machine, the first examples of docs/running.md and docs/moe.md, the planner
  of docs/planning.md, ``--help``) run as shown, and those with workers sync: bytes cross.

A doc example that stops parsing or stops syncing fails here.
"""

import json
import re
import shlex
import subprocess

import pytest

from harness import REPO, env, free_port

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DATA_FLAGS = ("--mock-data", "--data-path", "--train-data-path", "--load")
MIN_SYNCS = 3


def bash_blocks(path):
    """The ```bash blocks of a Markdown file, continuation lines joined, comments dropped."""
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*", "", line).strip()
            if line:
                yield line


def pretrain_argv(line):
    """The flags a line passes to pretrain_gpt.py (``launch/slurm.sh`` passes its own on), or
    None; elided parts dropped. Returns (argv, complete)."""
    complete = "..." not in line and "<" not in line
    line = re.sub(r"<[^>]*>", " ", line).replace("...", " ").replace("[", " ").replace("]", " ")
    words = shlex.split(line)
    for i, w in enumerate(words):
        if "pretrain_gpt.py" in w and " " in w:  # sbatch --wrap "srun ... pretrain_gpt.py ..."
            return pretrain_argv(w)[0], False
        if w.endswith("pretrain_gpt.py") or w == "launch/slurm.sh":
            return words[i + 1:], complete and w.endswith("pretrain_gpt.py")
    return None, False


def doc_commands():
    out = []
    for path in DOCS:
        for n, line in enumerate(bash_blocks(path)):
            argv, complete = pretrain_argv(line)
            if argv is not None:
                out.append(pytest.param(argv, complete, line,
                                        id=f"{path.name}-{n}-{' '.join(argv)[:40]}"))
    return out


@pytest.mark.parametrize("argv,complete,line", doc_commands())
def test_each_doc_command_parses_and_syncs(argv, complete, line):
    from megatron_streaming.cli.arguments import parse_args
    from megatron_streaming.streaming.settings import enabled

    if argv == ["--help"]:
        return  # run below
    given_data = any(f in argv for f in DATA_FLAGS)
    cfg = parse_args([*argv, *([] if given_data else ["--mock-data"])])
    s = cfg.streaming
    if complete and s.diloco_workers > 1:
        assert enabled(cfg)
        syncs = cfg.training.train_iters // s.diloco_inner_steps
        assert syncs >= MIN_SYNCS, f"{line}\nsyncs each fragment {syncs} times"


def test_the_docs_show_the_commands_this_file_runs():
    lines = [line for path in DOCS for line in bash_blocks(path)]
    assert len(doc_commands()) >= 14
    for expected in RUN:
        assert any(all(part in line for part in expected) for line in lines), expected


# The complete CPU-runnable commands, by what identifies their line (the first match runs).
RUN = [
    ("deepspeed --num_gpus 4 pretrain_gpt.py --mock-data --diloco-workers 2",),
    ("torchrun --nproc_per_node 4 pretrain_gpt.py --mock-data",),
    ("pretrain_gpt.py --help",),
    ("--nproc-per-node 4 pretrain_gpt.py --mock-data", "--num-experts 4"),
    ("-m megatron_streaming.plan", "--explain"),
]


def _line(*parts):
    return next(line for path in DOCS for line in bash_blocks(path)
                if all(p in line for p in parts))


def _run(line, tmp_path, timeout=420, extra=()):
    words = shlex.split(line) + list(extra)
    proc = subprocess.run(words, cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, line + "\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.timeout(1200)
def test_the_cpu_runnable_doc_commands_run_and_sync(tmp_path):
    """Run as shown, each with a summary written where the test reads it; with workers, bytes
    crossed and every fragment synced."""
    for parts in RUN:
        line = _line(*parts)
        summary = tmp_path / f"summary{RUN.index(parts)}.json"
        pretrain = "pretrain_gpt.py" in line and "--help" not in line
        out = _run(line, tmp_path, extra=["--summary-json", str(summary)] if pretrain else [])
        if not pretrain:
            assert out.strip(), line
            continue
        s = json.loads(summary.read_text())
        cfg_workers = 2 if "--diloco-workers 2" in line else 1
        assert s["workers"] == cfg_workers and s["stopped_by"] is None, line
        assert (s["cross_worker_bytes"] > 0) == (cfg_workers > 1), line


@pytest.mark.timeout(600)
def test_the_readme_two_clusters_run_on_one_machine(tmp_path):
    """The README's two launch lines, given --master-addr 127.0.0.1 as it says, at once."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Two clusters, one job"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [re.sub(r"(^|\s)#.*", "", x).strip() for x in block.replace("\\\n", " ").splitlines()]
    lines = [x for x in lines if x]
    assert len(lines) == 2
    port = str(free_port())
    procs = []
    for i, line in enumerate(lines):
        line = line.replace("--master-addr a001", "--master-addr 127.0.0.1")
        line = line.replace("--master-port 29500", f"--master-port {port}")
        words = shlex.split(line) + ["--summary-json", str(tmp_path / f"w{i}.json")]
        assert "--master-addr 127.0.0.1" in line and f"--master-port {port}" in line
        procs.append(subprocess.Popen(words, cwd=REPO, env=env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=540)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    summary = json.loads((tmp_path / "w0.json").read_text())  # the job's: global rank 0's
    assert (summary["iteration"], summary["workers"]) == (100, 2)
    assert summary["cross_worker_bytes"] > 0 and summary["stopped_by"] is None
