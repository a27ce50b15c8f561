"""The merger: the single writer of the global model.  Six packages, lowest first, each importing
only those before it and the configuration modules `config` and `settings`
(tests/test_merger_layers.py): `engines` (computing folds from codes), `fold` (the math and its
checks), `log` (the write-ahead log), `state` (`MergerCore`, rounds, pipeline, checkpoints,
recovery), `replication` (the standby) and `network` (the process's traffic).  Each says what it
owns in its `__init__`; docs/design.md has the table, docs/delta-life.md a delta's way through
them.  The process shell beside them: `main`, `flags`, `config`, `settings`, `starting`, `wiring`,
`service`, `roles`, `memory`.

May import: protocol, bus, telemetry, cliargs and third-party libraries; no other package of the
project.
"""
