"""The planner: memory and step-time models of one worker (``memory``, ``step_time``),
validated against measured runs (``benchmarks/plan_validation.py``)."""
