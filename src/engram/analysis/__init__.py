"""Looking inside a model and what its tables see: token-level gate maps (`gates.py`, `engram gates`) and table
statistics (`stats.py`, `engram stats`). The evidence experiments live apart, in the `engram_experiments` package."""
