"""The ABI: ``P3PeerSendConfig`` byte for byte (``config``), the layout formulas and the
range table (``layout``), and the error hierarchy (``errors``). Imports only the stdlib
and numpy; never touches CUDA."""
