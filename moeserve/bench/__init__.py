"""`moeserve bench`: a serving benchmark client for any OpenAI-compatible server.

cli.py (arguments, run), serving.py (load generator), datasets.py (workloads),
metrics.py (pure metric functions), report.py (table, JSON, PNG). Needs no engine code.
"""
