"""engram: DeepSeek's Engram (conditional memory via hashed n-gram lookup) for PyTorch.

    from engram import EngramConfig, BackBoneConfig, NgramHashMapping, Engram
"""

from . import config as _config
from .config import (
    BackBoneConfig,
    ConfigError,
    EngramConfig,
    load_config,
    save_config,
)
from .errors import EngramError
from .hashing import HashInputError, NgramHashMapping, get_hash_mapping
from .memory import Engram, MultiHeadEmbedding, ShortConv
from .tokenizer import CompressedTokenizer, TokenizerError
from .training.config import TrainConfig

__version__ = "0.2.0"

# `from engram.config import TrainConfig` (its home before training/config.py): still works, with a DeprecationWarning
_config.moved.add("TrainConfig", "engram.training.config", TrainConfig)
_config.moved.add("TRAIN_TABLE_BACKENDS", "engram.training.config", ("param", "mmap"), "TRAIN_TABLE_MODES")

_HF_NAMES = ("EngramLMConfig", "EngramForCausalLM", "EngramCache", "EngramCausalLMOutput")
_ADAPTER_NAMES = ("attach", "detach", "save_adapter", "load_adapter", "add_lora", "AdapterError", "get_engram_model",
                  "EngramAdapterModel", "EngramAdapterConfig")
_TRAINING_NAMES = ("hf_optimizers",)  # (training/hf.py: the optimizer argument of transformers.Trainer)
_EDIT_NAMES = ("edit_facts", "apply_overlay", "remove_overlays", "Overlay", "Fact", "EditError")


def __getattr__(name):
    """Lazy access to the Hugging Face classes, the adapter API, `hf_optimizers` and fact editing (importing
    transformers costs ~2 s)."""
    if name in _HF_NAMES:
        from . import model

        return getattr(model, name)
    if name in _ADAPTER_NAMES:
        from . import adapters

        return getattr(adapters, name)
    if name in _TRAINING_NAMES:
        from .training import hf

        return getattr(hf, name)
    if name in _EDIT_NAMES:
        from . import editing

        return getattr(editing, name)
    raise AttributeError(f"module 'engram' has no attribute {name!r}")


def _register_with_transformers() -> None:
    """Make `AutoModelForCausalLM.from_pretrained(dir)` work after `import engram`, without importing
    transformers eagerly: register now if it is loaded, else right after it first loads."""
    import importlib.abc
    import importlib.util
    import sys

    if "transformers" in sys.modules:
        from . import model  # noqa: F401  (registers on import)
        return
    if importlib.util.find_spec("transformers") is None:
        return

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != "transformers":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_register(module):
                exec_module(module)
                try:
                    from . import model  # noqa: F401
                except Exception:  # never break the user's transformers import
                    pass

            spec.loader.exec_module = exec_and_register
            return spec

    sys.meta_path.insert(0, _Hook())


_register_with_transformers()

__all__ = [
    "BackBoneConfig", "CompressedTokenizer", "ConfigError", "Engram", "EngramConfig", "EngramError", "HashInputError",
    "MultiHeadEmbedding", "NgramHashMapping", "ShortConv", "TokenizerError", "TrainConfig", "get_hash_mapping",
    "load_config", "save_config",
]
