"""The `dloco` command line: one subcommand per process (island, merger, broker) or tool (up,
experiment, bench, ...).

May import every package of the project; nothing imports it (it is the top of the layering)."""
