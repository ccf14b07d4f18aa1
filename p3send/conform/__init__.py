"""``p3send conform`` and ``p3send layout``: check a foreign declaration of
``P3PeerSendConfig`` against the ABI, and print the ABI in the form a user needs.

``check(path)`` / ``check_path(path)`` read a C/C++ header, Mojo source, or the JSON of
``render("json")``, lay the struct out, and compare it with ``abi.FIELDS``. C/C++ layouts
come from the system compiler, never from a model of C's rules: the real preprocessor
decides ``#if`` branches, macros and X-macros, a compiled probe measures every member, once
without and once with ``__CUDACC__`` (the views of a host compiler and of nvcc). Mojo has no
compiler here, so its (simple) rules are modelled. ``render(fmt)`` prints the ABI as a
table, JSON, C, Mojo or numpy source.

Sections: ``source`` (reading the file), ``toolchain`` (compilers, the CUDA headers),
``cscan`` (the preprocessed translation unit), ``cprobe`` (the compiler probe), ``cdecl``
(C/C++ per configuration), ``mojo``, ``jsondecl``, ``render`` (the layouts of ``p3send
layout``), ``verdict`` (the comparison and the report), ``check`` (the entry points).
Imports only ``p3send.abi`` and the standard library.
"""
from __future__ import annotations

from .cdecl import CResult, c_layout, c_results
from .check import check, check_path, read_layout
from .jsondecl import json_layout
from .model import STRUCT, DeclarationError, DeclarationFileError, Layout, Member, ParseError
from .mojo import mojo_layout, mojo_type
from .render import FORMATS, render
from .source import KINDS
from .toolchain import CUDACC_CHOICES, CompilerOptions, CudaHeaders, find_cuda_headers
from .verdict import Report, Verdict, compare

__all__ = [
    "CUDACC_CHOICES", "FORMATS", "KINDS", "STRUCT", "CResult", "CompilerOptions", "CudaHeaders",
    "DeclarationError", "DeclarationFileError", "Layout", "Member", "ParseError", "Report", "Verdict",
    "c_layout", "c_results", "check", "check_path", "compare", "find_cuda_headers", "json_layout",
    "mojo_layout", "mojo_type", "read_layout", "render",
]
