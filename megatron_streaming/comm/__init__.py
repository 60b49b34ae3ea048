"""Everything that crosses workers: the communicator (``crossworker``), the quantized exchange
(``codec``, ``transport``, and ``wire``: its packed rows on the wire), what counts as a lost peer
(``failures``), the background threads (``serial``) and the data-parallel yardstick
(``traffic``)."""
