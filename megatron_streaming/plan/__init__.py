"""The planner: memory and step-time models of one worker (``memory``, ``step_time``), the
search across clusters (``search``) and the utilisation simulator (``simulate``), validated
against measured runs (``benchmarks/plan_validation.py``)."""
