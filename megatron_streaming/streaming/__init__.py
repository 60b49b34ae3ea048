"""Streaming DiLoCo: what the flags mean (``settings``), fragments, schedule, outer optimizer,
the sync hooked into the ZeRO step (``sync``, ``canonical`` across layouts), its assembly
(``builder``) and its report."""
