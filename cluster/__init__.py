"""Launching a cluster: the cluster file, the processes' command lines, the launcher, live view,
compose, CPU quotas, chaos.

May import: analysis (to judge and report a run), the process packages and protocol; nothing from
suites or dloco.
"""
