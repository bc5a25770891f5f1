"""What the benchmarks run on: load generators (loadgen, wrk), the gateway rig, stub engines,
the gRPC floor, flame graphs, fleet metrics, and the observed stack."""
