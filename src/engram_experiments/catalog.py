"""Every experiment module of this package, imported in the order `engram experiment all` runs them: importing a
module registers its experiments (`registry.register`). The registry imports this module through the
`engram.experiments` entry-point group the first time it is asked for an experiment (`registry.load`).
"""

# isort: off
from . import preset  # noqa: F401  (iso, placement, capacity, ablations, sensitivity, design)
from . import retrofit  # noqa: F401
from . import edit  # noqa: F401
from . import allocation  # noqa: F401  (and its records: allocation-accounting, allocation-sweep)
from . import adapter_init  # noqa: F401
from . import smollm2_adapt  # noqa: F401
from . import smollm2_edit  # noqa: F401
from . import fact_editors  # noqa: F401
from . import fact_edits  # noqa: F401
from . import fact_scale  # noqa: F401
from . import adapt_budget  # noqa: F401
from . import records  # noqa: F401  (the records other commands write: stats)
# isort: on

# the order `engram experiment all` runs them and `--list` shows them (whatever imported a module first)
ORDER = ("iso", "placement", "capacity", "ablations", "sensitivity", "design", "retrofit", "edit", "allocation",
         "adapter-init", "smollm2-adapt", "smollm2-edit",
         "fact-edits-pilot", "fact-edits", "fact-scale-pilot", "fact-scale", "adapt-budget-pilot", "adapt-budget")
