"""FlexGen's offloading ``Policy``, as the policy search builds it.

The dataclass is the offload runtime's input and lives beside it
(``localgen.runtime.offload.policy``), below this package; the cost model, the search, the presets
and the saved-policy store produce and read it under this name.
"""

from localgen.runtime.offload.policy import FRACTIONS, SUM_TOL, Policy, assign_tiers

__all__ = ["FRACTIONS", "SUM_TOL", "Policy", "assign_tiers"]
