"""The sync-site counter of the device check (benchmarks/sync_sites.py), on the CPU: a C++
warning reaches it through torch's warning handler with the Python line that caused it, every
time (C++'s warn-once and Python's once per line both lifted), in the window of the step it
came in; other warnings pass on."""

import atexit
import json
import sys
import warnings
from types import SimpleNamespace

import numpy
import torch

from harness import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import sync_sites  # noqa: E402


def test_every_cxx_warning_is_counted_at_its_line_in_its_steps_window(tmp_path):
    previous = torch.is_warn_always_enabled()
    read_only = numpy.zeros(1)
    read_only.flags.writeable = False
    passed_on = []
    with warnings.catch_warnings():
        warnings.simplefilter("default")  # Python's own: once per line
        warnings.showwarning = lambda message, *rest, **kw: passed_on.append(str(message))
        counter = sync_sites.SyncCounter(SimpleNamespace(topology=SimpleNamespace(rank=3)),
                                         tmp_path, warmup=2, rehearse=True)
        atexit.unregister(counter.write)
        counter.last_step = 4
        try:
            for step in range(1, 6):  # 4 steps, then what follows the last one
                for _ in range(step):
                    torch.from_numpy(read_only)  # C++'s warn-once: here on every call
                warnings.warn("another warning")
                if step <= 4:
                    counter.after_step()
            counter.write()
        finally:
            torch.set_warn_always(previous)
    line = f"tests/test_sync_sites.py:{_line_of('torch.from_numpy(read_only)  # C++')}"
    record = json.loads((tmp_path / "sync_sites_rank3.json").read_text())
    # warm-up: steps 1 and 2 (1 + 2 calls, and the hook's own call at the end of each step);
    # steady: steps 3 and 4; after: step 5's calls
    here = {w: record["sites"][w].get(line, 0) for w in ("warmup", "steady", "after")}
    assert here == {"warmup": 3, "steady": 7, "after": 5}, record["sites"]
    hook = f"benchmarks/sync_sites.py:{_line_of('self.torch.from_numpy(', 'sync_sites')}"
    assert record["sites"]["warmup"][hook] == 2 and record["sites"]["steady"][hook] == 2
    assert record["steady_steps"] == 2 and record["threads"] == {"MainThread": 19}
    assert passed_on == ["another warning"]  # the others keep Python's rule


def _line_of(text, module="test_sync_sites"):
    path = REPO / ("benchmarks/sync_sites.py" if module == "sync_sites" else
                   "tests/test_sync_sites.py")
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)
