"""The merger: the single writer of the global model.

Pure core (no sockets, clocks or logging): `admission`, `weighting`, `rda`, `outer`,
`round_policy`, `fold`.  The service, write-ahead log and replay are built around it.
"""
