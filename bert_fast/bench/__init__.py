"""Benchmark machinery shared by the ``bert-fast`` CLI and the pytest-benchmark suites in benchmarks/."""
