"""Saving and loading this rank's part of a job-wide checkpoint (``Checkpointer``): a save's
start (this rank's tensors collected, the write planned, its files written at once or on a
thread: ``background``), its commit (``commit``), and the load of the latest checkpoint, its
files checked first (``store``). ``check_loadable`` checks a --load before any process group.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Callable, List, Optional, Sequence

from ..errors import first_line
from .background import FileWrite, PendingSave, Runner, Staging, in_place
from .commit import Commit, report_path
from .failures import ERRORS, attempt, is_read_error, text_of
from .resume import CheckpointError
from .store import check_files, check_safe, find_checkpoint, iteration_dir, share, worker_part


class Checkpointer(Commit):
    """Saves and loads this rank's part of a job-wide checkpoint: each worker writes its own
    part (``store``), in its own world; the job's leading rank (``leads``) commits the whole.

    ``state`` objects (``job.JobState``) give ``sharded_state_dict()``, ``rank_info()`` and
    ``describe()``; ``failed_ranks(flag)`` is a collective over every rank of every worker that
    returns the ranks whose flag is set (``CrossWorker.ranks_reporting``); ``gather(obj)`` every
    rank of this worker's object, in rank order; ``gather_workers(obj)`` every worker's, in
    worker order (a collective of every rank; each worker's first rank's object counts);
    ``members()`` the job's workers now (their indices). The commit of a save it starts
    (``progress``, ``advance``, ``finish_save``) is ``commit.Commit``'s."""

    def __init__(self, rank: int, failed_ranks: Callable[[bool], List[int]],
                 gather: Callable[[object], list], world: int = 1, worker: int = 0,
                 gather_workers: Callable[[object], list] = lambda obj: [obj],
                 leads: Optional[Callable[[], bool]] = None, local: Optional[int] = None,
                 members: Optional[Callable[[], Sequence[int]]] = None):
        from patches.megatron_save_plan import SavePlans

        self.rank = rank  # global
        self.world = world  # ranks per worker (this worker's)
        self.local = rank % world if local is None else local  # rank within the worker
        self.worker = worker
        self.failed_ranks = failed_ranks
        self.gather = gather
        self.gather_workers = gather_workers
        # Whether this rank commits for the job: global rank 0, or the first rank of the
        # lowest live worker once workers were lost (``elastic``).
        self.leads = leads or (lambda: rank == 0)
        self.members = members or (lambda: (worker,))
        self.staging = Staging()  # --async-save's copy of the tensors, kept between saves
        self.runner = Runner()  # --async-save's thread: the writes, the commits' stages
        self.plans = SavePlans()  # the latest save's plan, for the next of its structure

    def reserve_staging(self, state) -> int:
        """--async-save: make the host buffer the saves copy into now, beside training,
        instead of in the first save, start the thread they write on, and plan the saves
        (``plan_ahead``); returns the buffer's bytes. Collective within the worker, as
        ``state.sharded_state_dict`` is."""
        sharded = state.sharded_state_dict()
        self.runner.start()
        staged = self.staging.reserve(sharded)
        self.plan_ahead(sharded)
        return staged

    def plan_ahead(self, sharded: dict) -> None:
        """Plan a save of ``sharded`` now (megatron-core's validation and global metadata:
        collective within the worker), so that the saves of its structure plan on each rank
        alone. The planner makes a directory: a temporary one, made first, every rank of the
        worker learning whether each could (else nothing is planned)."""
        import tempfile

        try:
            directory = tempfile.mkdtemp(prefix="megatron-streaming-plan-")
        except OSError:
            directory = None
        try:
            if all(made is not None for made in self.gather(directory)):
                self.plans.plan_ahead(sharded, directory)
        finally:
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)

    def save(self, root: str, iteration: int, state, run_state: dict,
             keep_last: int = 0) -> str:
        """Write the checkpoint, then commit on the leading rank. A write that fails on any
        rank (disk full, read-only, no permission) fails the save on every rank with
        ``CheckpointWriteError``; the previous checkpoint stays the latest."""
        return self.finish_save(self.start_save(root, iteration, state, run_state),
                                keep_last)

    def start_save(self, root: str, iteration: int, state, run_state: dict,
                   background: bool = False) -> PendingSave:
        """Everything of a save that needs the step loop: this rank's tensors collected (and
        copied out when ``background``), the write planned; then its files written at once,
        or on a thread (``background``: ``PendingSave.written`` tells when).

        A save that plans afresh (the first, or one whose structure changed) plans with
        every rank of the worker (megatron-core's validation and global metadata), once the
        worker's first rank has checked the free space and told the others; one of the
        structure of the kept plan (``SavePlans``; ``plan_ahead``) plans, checks the space
        and writes on each rank alone (in the background all three on the write's thread,
        after the copy). Either way a failure is learnt by every rank at the
        commit; nothing here crosses between workers."""
        final = iteration_dir(root, iteration)
        partial = final + ".partial"
        part = f"worker{self.worker}"
        mine = os.path.join(partial, part)

        # No collective across workers here: each worker's ranks make their part of the
        # partial directory themselves, and what a crash mid-save left in it is removed at
        # the commit (``store.commit``: what the checkpoint does not list).
        t0 = time.perf_counter()
        sharded = state.sharded_state_dict()
        same = self.plans.matches(sharded)
        sharded = self.staging.snapshot(sharded) if background else in_place(sharded)
        t1 = time.perf_counter()
        gathered = self.gather(({**state.rank_info(), "keys": sorted(sharded)},
                                same))
        infos = [info for info, _ in gathered]
        need = sum(i.get("bytes", 0) for i in infos)
        reuse = all(same for _, same in gathered)  # the same on every rank of the worker
        request = []

        def make_part():  # a worker without the shared filesystem makes its own partial
            os.makedirs(mine, exist_ok=True)
            _check_space(mine, need)

        def plan():
            request.append(self.plans.request(sharded, mine, reuse))

        def part_and_plan():
            make_part()
            return self.plans.request(sharded, mine, True)

        if reuse and background:
            # The rest is this rank's alone, its tensors copied out: on the write's thread
            # (a failure there is flagged, as a failed write is).
            error, t2 = None, time.perf_counter()
            request.append(part_and_plan)
        elif reuse:  # this rank's own plan: no collective until the commit
            error = attempt(make_part)
            t2 = time.perf_counter()
            error = error or attempt(plan)
        else:
            # Inside the planner's collectives (within the worker) a failure on one rank
            # only would leave the others waiting: a disk that cannot take the save stops
            # every rank of the worker before them (its first rank checks).
            error = attempt(make_part) if self.local == 0 else None
            t2 = time.perf_counter()
            if all(text is None for text in self.gather(text_of(error))):
                error = attempt(plan)
        # Any failure so far is learnt by every rank at the commit: a worker that plans
        # afresh and one that does not run the same collectives across workers.
        # On a GPU a synchronous save's device tensors are copied to host memory by its
        # write, in the step loop; a background save's were copied out above.
        report = report_path(partial, part, self.local) if background and error is None else None
        write = FileWrite(request[0] if request else None, mine, report)
        t3 = time.perf_counter()
        pending = PendingSave(root, iteration, partial, final, part, infos, write,
                              {"collect": t1 - t0,
                               "describe": t2 - t1, "plan": t3 - t2},
                              run_state, state.describe, error)
        if background and error is None:
            write.start(self.runner)
        else:
            write.run()
        return pending

    def verify(self, root: str, part: str) -> None:
        """Every file of the checkpoint's part ``part`` (``store.worker_part``), its SHA-256
        checked, each rank of the worker checking its share in parallel, and the pickled
        files' safety (the worker's first rank); every rank learns the verdict (collective)."""
        error = None
        directory, meta = find_checkpoint(root)
        try:
            files = sorted(f for f in meta["files"] if not part or f.startswith(part + "/"))
            check_files(root, directory, meta, hashes=set(share(files, self.local,
                                                                self.world)), part=part)
            if self.local == 0:
                check_safe(root, directory, (part,))
        except CheckpointError as e:
            error = e
        failed = self.failed_ranks(error is not None)
        if failed:
            if error is None:
                error = CheckpointError(f"--load {root}: a file of {directory} was altered "
                                        f"after it was written (see the message of rank "
                                        f"{failed[0]})")
            raise error

    def load(self, root: str, state, plan) -> dict:
        """Restore everything; returns the run state saved with it (iteration, ...)."""
        directory, meta = find_checkpoint(root)
        part = worker_part(meta, plan.part_worker)
        started = time.perf_counter()
        self.verify(root, part)
        self.timings = {"verify": time.perf_counter() - started}
        try:
            self.timings.update(state.load(directory, meta, plan, part) or {})
        except CheckpointError:
            raise
        except ERRORS as e:
            if is_read_error(e):
                raise CheckpointError(f"--load {root}: cannot read "
                                      f"{os.path.join(directory, part)}: "
                                      f"{first_line(e)}") from None
            raise
        return meta["run"]


def _check_space(directory: str, tensor_bytes: int) -> None:
    import errno

    need = int(tensor_bytes * 1.02) + (1 << 20)  # torch's per-tensor headers, the metadata
    free = shutil.disk_usage(directory).free
    if need > free:
        raise OSError(errno.ENOSPC, f"No space left on device for the checkpoint "
                                    f"({need / 2**20:.1f} MiB needed, {free / 2**20:.1f} MiB "
                                    "free)")


def check_loadable(root: str, cfg, layout, vocab_size=None):
    """The latest checkpoint's (directory, JSON), after checking that it fits this run and
    that its files are all there at their written sizes. Needs no process group, so a wrong
    --load fails before any collective."""
    from .resume import check_compatible

    directory, meta = find_checkpoint(root)
    check_files(root, directory, meta, hashes=False)
    check_compatible(root, meta, cfg, vocab_size)
    return directory, meta
