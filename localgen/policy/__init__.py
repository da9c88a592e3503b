"""Offloading policy: FlexGen's cost model and LP search (§4.3, App. A.3) -> Policy."""

from localgen.policy.policy import Policy
from localgen.policy.store import load_saved_policy, save_policy

__all__ = ["Policy", "load_saved_policy", "save_policy"]
