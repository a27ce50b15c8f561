"""The math of a fold and its checks, pure:

- `admission`: what a delta must be to be admitted (staleness, layout, finite, its norm);
- `outliers`: the references a delta's norm and an island's part of a fold are judged against,
  and quarantine;
- `weighting`: each island's weight in a fold; `contribution`: a delta as the fold takes it;
- `merge`: the fold itself (`fold`): per-island parts, the merge, the guard, the outer step;
- `clipping`: the guard's scaling of parts; `rda`: weighted and radial-directional averages;
- `outer`: the outer optimizers (Nesterov and its variants, SGD);
- `warmup`: compiling the engines' loops and each fragment's outer step ahead of the first fold.

May import the merger's `engines` and `config`; nothing with sockets, disks or threads.
"""
