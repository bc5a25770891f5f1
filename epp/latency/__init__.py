"""Predicted latency: the data the producer writes, the predictor client, its circuit breaker."""
