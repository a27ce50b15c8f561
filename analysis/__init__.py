"""Post-run analysis: read a run directory (events, metrics, the merger's log), judge it, evaluate
the global model, write the report.

May import: cluster (its config), island, merger, protocol, numpy and matplotlib; nothing from
suites or dloco.
"""
