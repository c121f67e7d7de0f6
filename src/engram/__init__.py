"""engram: DeepSeek's Engram (conditional memory via hashed n-gram lookup) for PyTorch.

    from engram import EngramConfig, BackBoneConfig, NgramHashMapping, Engram
"""

from .config import BackBoneConfig, ConfigError, EngramConfig, load_config, save_config
from .hashing import HashInputError, NgramHashMapping, get_hash_mapping
from .memory import Engram, MultiHeadEmbedding, ShortConv
from .tokenizer import CompressedTokenizer, TokenizerError

__version__ = "0.1.0"

__all__ = [
    "BackBoneConfig", "CompressedTokenizer", "ConfigError", "Engram", "EngramConfig", "HashInputError",
    "MultiHeadEmbedding", "NgramHashMapping", "ShortConv", "TokenizerError", "get_hash_mapping",
    "load_config", "save_config",
]
