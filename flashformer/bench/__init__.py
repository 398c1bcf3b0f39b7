"""Benchmarks: each writes JSON and a PNG; run them with `flashformer bench NAME`."""
