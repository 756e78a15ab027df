"""Harness code shared by tests/ and bench/: neither imports the other, both import this (an
import-linter contract in pyproject.toml keeps it so). What a test and a benchmark both need to
drive a real daemon: the packaged photos and the decode corpus built from them, the tiny models,
its stderr records read back, a free port, a sha256, a timestamped log line."""
