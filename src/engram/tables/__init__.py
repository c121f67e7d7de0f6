"""Where Engram rows live: the `Table` interface (`base.py`) and one stored-rows layer under it:

    codecs/ (how rows are stored as bytes)  ->  encoded.py (EncodedTable: bytes gathered, decoded after)
                                            ->  rows.py (open_rows: any source, in the ram / mmap / disk tier)

The float tiers are `trainable.py` (InRamTable, MmapTable: the ones training writes to, with `rowcache.py` and
`journal.py`) and `disk.py` (DiskTable); the file format is `files.py`, GGUF files `gguf.py`; `offload.py` moves a
model's tables into a tier, `quant.py` serves them in another row format; block checksums (`blocks.py`), the lookup
prefetcher (`prefetch.py`) and row overlays (`overlay.py`, used by `engram edit`). Row shards over ranks are in
`engram.distributed`."""

from . import gguf  # noqa: F401  (registers GGUF files with open_rows)
from .base import (
                    Table,
                    TableError,
                    find_tables,
                    install,
                    installed_tables,
                    row_grads,
                    uninstall,
)
from .encoded import EncodedTable
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
from .offload import offload_tables, restore_tables
from .overlay import OverlayTable, push_overlay, remove_overlays
from .prefetch import PendingRows, Prefetcher, readahead_for
from .rowcache import RowCache
from .rows import TIERS, RowBlocks, SegmentedTable, StoredTensor, open_rows
from .trainable import InRamTable, MmapTable

__all__ = ["EncodedTable", "InRamTable", "MmapTable", "OverlayTable", "PendingRows", "Prefetcher", "RowBlocks",
           "RowCache", "SegmentedTable", "StoredTensor", "TIERS", "Table", "TableError", "UndoJournal",
           "create_table_file", "find_tables", "install", "installed_tables", "new_table_file", "offload_tables",
           "open_rows", "push_overlay", "readahead_for", "remove_overlays", "restore_tables", "row_grads",
           "table_entries", "table_file", "tensor_entry", "uninstall", "write_safetensors", "write_table_file"]
