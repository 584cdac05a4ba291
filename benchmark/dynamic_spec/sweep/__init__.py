"""bench_sweep.py's parts: configs, server, client, workloads, results and CLI."""
