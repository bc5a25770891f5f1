"""Fitting the simulator's engine profiles (``sim.engine``) to a real engine, and checking them:
the servers and workload that probe a served engine, the least-squares fit, fidelity, term
attribution, GPU step times."""
