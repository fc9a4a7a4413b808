"""fleet's benchmarks: one module per benchmark, each run as `python -m benchmarks.NAME` from the
repository's root (the wrappers `scripts/bench-*` and `scripts/profile-control-plane` do the
set-up first). What they share (percentiles, the side-by-side table, the closing JSON line,
CPU readings, the fleets and gateways they start) is in `benchmarks.harness`.

This package is not part of the wheel: it measures fleet from a checkout, and some benchmarks
use the test suite's helpers (`tests.pgserver`, `tests.integration.harness`, `tests.registry`).
"""
