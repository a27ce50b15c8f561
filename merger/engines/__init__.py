"""What computes a fold from coded deltas, named by engine:

- `coded`: plans a round's merge from codes and dispatches it (dense int codes or sparse ones);
- `dense_loops`: numba loops over dense int codes (norms, the merge, the fused Nesterov step);
- `sparse_xla`: XLA kernels for sparse codes (scatter-adds, the outer step over tiles);
- `fused`: a fold of dense codes under Nesterov computed whole, merge and step in one pass;
- `scratch`: the memory those folds reuse, and the fragment states' flat buffers.

Imports nothing else of the merger: pure functions of arrays and memory bookkeeping.
"""
