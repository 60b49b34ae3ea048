"""The job across workers: the rendezvous store, the door (same job, every worker's shape:
``door``, ``workers``), membership epochs and elastic workers, liveness and the stop agreement
(``lifecycle``)."""
