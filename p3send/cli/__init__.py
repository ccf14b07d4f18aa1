"""The ``p3send`` commands: layout and ``conform``, ``check-ptx``, ``demo``, ``bench``,
``trace``. Each subcommand imports only what it needs."""
from .app import main

__all__ = ["main"]
