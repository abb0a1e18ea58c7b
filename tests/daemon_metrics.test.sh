#!/bin/sh
# kvtierd /metrics: latency histograms (buckets, invariants, counts) and reason-labelled counters.
exec /usr/bin/python3 tests/daemon_metrics.py
