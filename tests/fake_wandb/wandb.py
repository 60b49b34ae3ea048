"""A stand-in for the ``wandb`` package (not a dependency of this project): records every call
as a JSON line in ``$FAKE_WANDB_LOG``. Put this directory on ``PYTHONPATH`` (end-to-end runs)
or into ``sys.modules`` (in-process tests)."""

import json
import os


def _record(call: str, **fields) -> None:
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({"call": call, **fields}, default=str) + "\n")


class Run:
    def log(self, data, step=None):
        _record("log", data=data, step=step)

    def finish(self):
        _record("finish")


def init(project=None, name=None, dir=None, config=None, entity=None, **rest):
    _record("init", project=project, name=name, dir=dir, entity=entity,
            config_keys=sorted(config or {}), rest=sorted(rest))
    return Run()
