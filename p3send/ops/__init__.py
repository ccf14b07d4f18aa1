"""The operations: the typed launchers (``send``, ``recv``), the one-GPU combine round
(``combine``), real ranks (``rank``, ``exchange``, ``procs``)."""
