"""Benchmarks behind `localgen bench`: each measures localgen beside a peer in the same run."""
