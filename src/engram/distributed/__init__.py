"""Row-sharded Engram tables over torch.distributed (gloo on CPU, NCCL on GPU)."""

from .sharded import ShardedTable, load_sharded, save_sharded

__all__ = ["ShardedTable", "load_sharded", "save_sharded"]
