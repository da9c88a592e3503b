"""Hardware probes -> HardwareProfile (bandwidths bytes/s, FLOP/s, capacities bytes)."""

from localgen.profiler.hardware import HardwareProfile, load_profile, shipped_profile_names, user_config_dir

__all__ = ["HardwareProfile", "load_profile", "shipped_profile_names", "user_config_dir"]
