"""The oracle: the numpy reference of the send, the signal and the reduce (``reference``),
seeded case generators (``cases``) and verified world rounds (``rounds``). Used by tests,
the demo and the bench; never by the runtime (``abi``, ``cuda``, ``ops``)."""
