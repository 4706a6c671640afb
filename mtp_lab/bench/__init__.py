"""Benchmarks and evaluation: kernel microbenchmarks, end-to-end A/B, the eval harness, the tables.

Every benchmark appends rows to a CSV through `common.append_rows`, which stamps each row with the
device name, torch/triton versions, commit and time; plots are drawn from those rows only.
"""
