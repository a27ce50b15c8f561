"""The `dloco` command line and, later, the local multi-island launcher."""
