"""Storage backends for Engram tables (see `backends.py`) and the lookup prefetcher (`prefetch.py`)."""

from .backends import (InRamTable, MmapTable, TableBackend, create_table_file, new_table_file, offload_tables,
                       restore_tables, table_file, tensor_entry, write_safetensors, write_table_file)
from .prefetch import Prefetcher

__all__ = ["InRamTable", "MmapTable", "Prefetcher", "TableBackend", "create_table_file", "new_table_file",
           "offload_tables", "restore_tables", "table_file", "tensor_entry", "write_safetensors", "write_table_file"]
