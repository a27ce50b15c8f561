"""A hot standby (PROTOCOL.md §12):

- `wire`: the replication messages and their framing;
- `primary`: the primary's side, its log streamed to the standby, the lease, fencing;
- `stream`, `channel`: what that stream keeps and the sockets it runs on;
- `standby`: following a primary, and taking over when its lease lapses;
- `consensus`: with `--etcd`, the lease as a key in etcd, claimed and renewed.

May import the merger's `engines`, `fold`, `log`, `state` and configuration modules.
"""
