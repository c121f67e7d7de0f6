"""N-gram hashing: token ids -> per-head row indices into the Engram tables (pure, no nn.Module).

- `families.py`: a `HashFamily` is one family's constants and how they derive (`DeepSeekFamily`, the
  reference's; the integrations' own families), found by manifest name through the registry
  (`family_class`, `register_family`).
- `identity.py`: what decides which row an n-gram reads, read off a family's manifest (`SPEC_FILE`):
  `spec_identity`, `identity_digest`, `check_identity`, `check_digest`. Models, adapters, overlays and
  checkpoints compare exactly this.
- `inputs.py`: what the engine accepts (`validate_ids`, `dead_mask`; `HashInputError`).
- `engine.py`: `NgramHashMapping`, the one engine for every family (validation, the fused kernel or the
  torch path, EOS resets and DEAD masks as per-position document starts; `kernel=`: one of `KERNELS`);
  `get_hash_mapping(cfg)`.
- `kernels.py`: the fused CPU kernel (numba, optional), and the split-modulo arithmetic the vLLM step's kernel
  compiles into its own (`split_mix`, `reduce_mix`).
"""

from .engine import KERNELS, NgramHashMapping, get_hash_mapping
from .families import (
    FAMILIES,
    HASH_MODES,
    PRIME_1,
    DeepSeekFamily,
    HashFamily,
    family_class,
    head_moduli,
    layer_multipliers,
    next_unused_prime,
    register_family,
)
from .identity import (
    IDENTITY_KEYS,
    SPEC_FILE,
    SPEC_FORMAT,
    check_digest,
    check_identity,
    identity_digest,
    legacy_identity_digest,
    spec_identity,
)
from .inputs import HashInputError

__all__ = ["FAMILIES", "HASH_MODES", "IDENTITY_KEYS", "KERNELS", "PRIME_1", "SPEC_FILE", "SPEC_FORMAT",
           "DeepSeekFamily", "HashFamily", "HashInputError", "NgramHashMapping", "check_digest", "check_identity",
           "family_class", "get_hash_mapping", "head_moduli", "identity_digest", "layer_multipliers",
           "legacy_identity_digest", "next_unused_prime", "register_family", "spec_identity"]
