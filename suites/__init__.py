"""The experiment suites: named sets of cluster runs side by side, their comparisons, tables and
plots.

May import: cluster, analysis, protocol, numpy and matplotlib; nothing from dloco."""
