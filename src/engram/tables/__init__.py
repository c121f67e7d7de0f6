"""Where Engram rows live: the `Table` interface (`base.py`), in-RAM and memory-mapped backends
(`backends.py`, with `rowcache.py` and `journal.py`; the file format in `files.py`), the disk tier (`disk.py`),
quantized rows (`quant.py`), block checksums (`blocks.py`), the lookup prefetcher (`prefetch.py`) and row
overlays (`overlay.py`, used by `engram edit`). Row shards over ranks are in `engram.distributed`."""

from .backends import InRamTable, MmapTable, offload_tables, restore_tables
from .base import (
                    Table,
                    TableError,
                    find_tables,
                    install,
                    installed_tables,
                    row_grads,
                    uninstall,
)
from .files import (
                    create_table_file,
                    new_table_file,
                    table_entries,
                    table_file,
                    tensor_entry,
                    write_safetensors,
                    write_table_file,
)
from .journal import UndoJournal
from .overlay import OverlayTable, push_overlay, remove_overlays
from .prefetch import PendingRows, Prefetcher, readahead_for
from .rowcache import RowCache

__all__ = ["InRamTable", "MmapTable", "OverlayTable", "PendingRows", "Prefetcher", "RowCache", "UndoJournal", "Table",
           "TableError", "create_table_file", "find_tables", "install", "installed_tables", "new_table_file",
           "offload_tables", "push_overlay", "readahead_for", "remove_overlays", "restore_tables", "row_grads",
           "table_entries", "table_file", "tensor_entry", "uninstall", "write_safetensors", "write_table_file"]
