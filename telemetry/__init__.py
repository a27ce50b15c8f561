"""Structured logging that every process sets up the same way (`logs.configure_logging`).

May import: structlog and the standard library only."""
