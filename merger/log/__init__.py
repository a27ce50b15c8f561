"""The write-ahead log and what it holds:

- `wal`: the writer (append, group commit, fsync, a torn tail truncated on open);
- `segments`: its files, read record by record (corruption named, never skipped);
- `records`: the record formats (genesis, delta, fold, cursors, term) and their arrays;
- `logmatch`: a log's identity (its genesis, terms, newest epoch), for replay and a standby;
- `rundir`: one merger per run directory (a lock) and which shard a directory belongs to.

May import the merger's `engines`, `fold` and configuration modules.
"""
