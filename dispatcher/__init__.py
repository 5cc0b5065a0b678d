"""Delivers committed effects: claim with SKIP LOCKED, deliver, record fenced outcomes."""

from dispatcher._core import Dispatcher
from dispatcher.handlers import EffectContext, HttpHandler, Registry, load_registry
from dispatcher.policy import Decision, RetryPolicy

__all__ = [
    "Decision",
    "Dispatcher",
    "EffectContext",
    "HttpHandler",
    "Registry",
    "RetryPolicy",
    "load_registry",
]
