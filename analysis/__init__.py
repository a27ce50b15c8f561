"""Post-run analysis: read a run directory (events, metrics, the merger's log), judge it, evaluate
the global model, write the report.

May import: island, merger, protocol, numpy and matplotlib; nothing from cluster (the analysis
takes plain values: report.RunOutline), suites, sim or dloco (tests/test_layering.py).
"""
