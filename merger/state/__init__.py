"""The merger's state machine, without sockets:

- `core`: `MergerCore`, the fragment states and every delta's result: offer, admit, fold, install;
- `rounds`, `round_policy`: the deltas waiting per fragment and when a round folds;
- `pipeline`: folds computed on a worker thread while the loop goes on, installed once durable;
- `checkpoint`, `recovery`: the whole state on disk now and then, and rebuilt from a checkpoint
  and the log by replay (`dloco replay`);
- `param_norms`, `trained_tokens`: a fragment's norm for the guard, the cluster's trained tokens.

May import the merger's `engines`, `fold`, `log` and configuration modules.
"""
