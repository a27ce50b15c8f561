"""Structured logs for every process: structlog JSON lines on stdout (console rendering in a tty),
bound with the process's role and identity."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(role: str, level: str = "info", **context: str) -> structlog.stdlib.BoundLogger:
    renderer = structlog.dev.ConsoleRenderer() if sys.stdout.isatty() else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(role=role, **context)
    return structlog.get_logger()
