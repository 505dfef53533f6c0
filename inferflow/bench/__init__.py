"""Benchmarks: ``inferflow bench`` (offline throughput, serving latency, peers, precision classes, plots,
profiles). The entry point is :func:`inferflow.bench.cli.bench_main`."""
