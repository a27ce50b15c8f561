"""The merger process's traffic, each part an object the poll loop (merger/service.py) drives:

- `receiving`: delta chunks decoded, ordered per island, reassembled and offered to the core;
- `streams`: islands' streams watched, gaps and lost tails asked for again;
- `announcing`: each fold logged, its snapshot offered, its members acknowledged;
- `publishing`, `snapshot_form`: snapshots on the bus (full or diffs) and catch-up replies.

May import the merger's `engines`, `fold`, `log`, `state` and configuration modules.
"""
