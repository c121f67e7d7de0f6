"""Storage backends for Engram tables (see `backends.py`) and the lookup prefetcher (`prefetch.py`)."""

from .backends import InRamTable, MmapTable, TableBackend, offload_tables, write_table_file
from .prefetch import Prefetcher

__all__ = ["InRamTable", "MmapTable", "Prefetcher", "TableBackend", "offload_tables", "write_table_file"]
