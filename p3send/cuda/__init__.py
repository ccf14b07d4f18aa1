"""The CUDA seam: ``driver`` (the only module that calls ``cuda.bindings``), ``loader``
(PTX loading and linking, parameter checks against each file's documented table) and
``ptxdoc`` (the PTX header parser)."""
