"""Simulator, workloads and benchmark harness for kvroute (not shipped in the wheel)."""
