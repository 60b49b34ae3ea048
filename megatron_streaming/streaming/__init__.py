"""Streaming DiLoCo: what the flags mean (``settings``), fragments, schedule, outer optimizer,
the sync hooked into the ZeRO step (``sync``, ``canonical`` across layouts, ``one_worker``'s
exchange with nobody), its assembly (``builder``), its report, what a checkpoint keeps of it
(``saved``) and what a change of the job's members does to it (``membership``)."""
