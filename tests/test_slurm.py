"""launch/slurm.sh under a real SLURM: a one-node cluster on this machine (slurm_cluster.py:
Debian's slurm-wlm and munge, installed when missing, daemons stopped afterwards) runs the
batch script the way docs/slurm.md submits it, in both forms:

* one job holding both workers, each worker its own job step sharing the node (GPUS_PER_NODE=4
  slots split 0,1 / 2,3 through the launcher's --include);
* the multi-cluster form: one job per worker, both against a common --master-addr/--master-port;
* the time-limit path: USR1 to the batch shell (what --signal=B:USR1@300 sends), SIGTERM to
  the steps, a checkpoint, the job requeues itself and the rerun resumes from --load;
* no batch script of ours: a bare ``srun python pretrain_gpt.py`` whose two tasks are the
  job's two ranks (SLURM's task variables read as a launcher's, ``megatron_streaming.parallel.slurm``).

Each checks the job's final state in ``scontrol show job`` (no accounting, so no sacct) and the
run's --summary-json. Skipped with the reason where the cluster cannot run: not root, no
package access, daemons that do not come up.
"""

import contextlib
import json
import math
import re
import shlex
import time

import pytest

import slurm_cluster
from harness import REPO, free_port

TRAIN_ITERS = 6
# As small as a streaming run gets: 2 workers x TP=2, a sync every 2 steps, a few iterations.
TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--train-iters", str(TRAIN_ITERS),
        "--diloco-workers", "2", "--tensor-model-parallel-size", "2",
        "--diloco-inner-steps", "2", "--log-interval", "2", "--eval-iters", "1",
        "--diloco-timeout", "180"]
JOB_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCHDYNAMO_DISABLE": "1"}  # as harness.env
JOB_TIMEOUT = 600


@pytest.fixture(scope="module")
def cluster():
    stack = contextlib.ExitStack()
    try:
        running = stack.enter_context(slurm_cluster.one_node_cluster())
    except slurm_cluster.Unavailable as e:
        pytest.skip(f"no one-node SLURM cluster here: {e}")
    with stack:
        yield running


def finished(cluster, job: int, out) -> str:
    """Waits for ``job``; asserts it COMPLETED with exit code 0:0; returns its output."""
    info = cluster.wait(job, timeout=JOB_TIMEOUT)
    text = out.read_text(errors="replace") if out.exists() else "(no output file)"
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), \
        f"job {job}: {info['JobState']} {info['ExitCode']}\n{text[-6000:]}"
    return text


def check_summary(path, world_size: int = 4) -> dict:
    summary = json.loads(path.read_text())
    assert summary["iteration"] == TRAIN_ITERS
    assert summary["workers"] == 2 and summary["world_size"] == world_size
    assert summary["cross_worker_bytes"] > 0
    assert math.isfinite(summary["train_loss"]) and math.isfinite(summary["valid_loss"])
    return summary


@pytest.mark.timeout(900)
def test_one_job_runs_each_worker_as_a_job_step(cluster, tmp_path):
    out = tmp_path / "job.out"
    job = cluster.sbatch(["--nodes=1", f"--output={out}", "launch/slurm.sh", *TINY,
                          "--summary-json", str(tmp_path / "summary.json")],
                         cwd=REPO, env={**JOB_ENV, "GPUS_PER_NODE": "4",
                                        "MASTER_PORT": str(free_port())})
    text = finished(cluster, job, out)
    check_summary(tmp_path / "summary.json")
    # Two steps, the node's four slots split between them.
    assert f"worker 0 on {cluster.node} (devices: 0,1)" in text
    assert f"worker 1 on {cluster.node} (devices: 2,3)" in text
    steps = set(re.findall(rf"launch task StepId={job}\.(\d+)", cluster.log("slurmd.log")))
    assert steps == {"0", "1"}, cluster.log("slurmd.log")[-3000:]


@pytest.mark.timeout(900)
def test_one_job_per_cluster_meets_at_a_common_rendezvous(cluster, tmp_path):
    port = free_port()
    jobs = []
    for worker in (0, 1):  # one rank each: what is under test is where they meet
        flags = [*TINY, "--tensor-model-parallel-size", "1", "--diloco-worker-index",
                 str(worker), "--master-addr", "127.0.0.1", "--master-port", str(port),
                 "--summary-json", str(tmp_path / f"w{worker}.json")]
        jobs.append(cluster.sbatch(["--nodes=1", f"--output={tmp_path}/w{worker}.out",
                                    "launch/slurm.sh", *flags],
                                   cwd=REPO, env={**JOB_ENV, "GPUS_PER_NODE": "1"}))
    for worker, job in enumerate(jobs):
        finished(cluster, job, tmp_path / f"w{worker}.out")
    # Worker 0's first rank is global rank 0, which reports for the whole run.
    check_summary(tmp_path / "w0.json", world_size=2)
    assert not (tmp_path / "w1.json").exists()


@pytest.mark.timeout(120)
def test_worker_index_without_rendezvous_is_refused(cluster, tmp_path):
    out = tmp_path / "job.out"
    job = cluster.sbatch(["--nodes=1", f"--output={out}", "launch/slurm.sh", *TINY,
                          "--diloco-worker-index", "1"], cwd=REPO, env=JOB_ENV)
    info = cluster.wait(job, timeout=60)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0")
    assert "--diloco-worker-index needs --master-addr and --master-port" in out.read_text()


REQUEUE_ITERS = 60


@pytest.mark.timeout(900)
def test_usr1_checkpoints_requeues_and_the_rerun_resumes(cluster, tmp_path):
    out, ckpt, summary = tmp_path / "job.out", tmp_path / "ckpt", tmp_path / "summary.json"
    # One rank per worker: the path under test is the job's, and the job starts twice.
    flags = [*TINY, "--tensor-model-parallel-size", "1", "--train-iters", str(REQUEUE_ITERS),
             "--log-interval", "10", "--save", str(ckpt), "--load", str(ckpt),
             "--summary-json", str(summary)]
    job = cluster.sbatch(["--nodes=1", f"--output={out}", "launch/slurm.sh", *flags],
                         cwd=REPO, env={**JOB_ENV, "GPUS_PER_NODE": "2",
                                        "MASTER_PORT": str(free_port())})
    deadline = time.monotonic() + JOB_TIMEOUT
    while not re.search(r"iteration +\d+0/", out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline and cluster.job(job)["JobState"] in (
            "PENDING", "RUNNING"), out.read_text()[-6000:] if out.exists() else "no output"
        time.sleep(0.5)
    cluster.command("scancel", "--signal=USR1", "--batch", str(job))
    text = finished(cluster, job, out)
    assert cluster.job(job)["Restarts"] == "1", text[-6000:]
    assert f"slurm.sh: requeueing job {job}" in text
    resumed = re.search(rf"resumed from {re.escape(str(ckpt))} at iteration (\d+)", text)
    assert resumed and 0 < int(resumed.group(1)) < REQUEUE_ITERS, text[-6000:]
    assert json.loads(summary.read_text())["iteration"] == REQUEUE_ITERS


@pytest.mark.timeout(600)
def test_a_bare_srun_runs_each_task_as_a_rank_of_the_job(cluster, tmp_path):
    """Two tasks, two one-rank workers: one job of world size 2 (each task trained alone as
    a world of one before), its rendezvous on the step's first node at the port drawn from
    the job and step ids."""
    out, summary = tmp_path / "job.out", tmp_path / "summary.json"
    flags = [*TINY, "--tensor-model-parallel-size", "1", "--summary-json", str(summary)]
    command = shlex.join([str(REPO / ".venv" / "bin" / "python"), "pretrain_gpt.py", *flags])
    job = cluster.sbatch(["--ntasks=2", f"--output={out}", f"--wrap=srun {command}"],
                         cwd=REPO, env=JOB_ENV)
    text = finished(cluster, job, out)
    result = json.loads(summary.read_text())
    assert (result["iteration"], result["workers"], result["world_size"]) == (TRAIN_ITERS, 2, 2)
    assert result["cross_worker_bytes"] > 0 and math.isfinite(result["train_loss"])
    assert f"launch: SLURM step {job}.0: 2 tasks on {cluster.node} as the job's ranks " \
        "(SLURM_PROCID, SLURM_LOCALID), rendezvous at " in text, text[-6000:]
    assert text.count("launch: SLURM step") == 1, text[-6000:]  # said once, by rank 0
