"""Shipped HardwareProfile JSON files (installed as ``localgen.profiles``)."""
