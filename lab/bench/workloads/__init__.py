"""The benchmarks' workloads: the public request traces, the fleet workloads by name, and what a
live replay sends."""
