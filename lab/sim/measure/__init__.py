"""Measuring live processes and writing down what was measured, for the fitting tools
(``sim.fitting``) and the benchmarks (``bench``): Prometheus samples, and results as JSON,
Markdown and PNG."""
