"""Benchmarks, the correctness check of `make bench` and the static GPU report."""
