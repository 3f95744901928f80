"""train's options for a run's events as they happen (orchestrator/observe/delivery.py)."""

from __future__ import annotations

import functools
import os

import click

from orchestrator.observe.delivery import SECRET_ENV, EventConfig, save_config
from orchestrator.runs.notify import save_notify
from orchestrator.runs.store import Run
from orchestrator.observe.events import KINDS


def event_options(f):
    """Adds --notify-on, --webhook and --heartbeat to train (under its @cluster_options: `opts` and
    `notify` are train's), passed on resolved and checked as `events` (an EventConfig)."""

    @click.option("--notify-on", metavar="EVENTS", default=None,
                  help="Run --notify for these events as they happen, each one's JSON on stdin and in "
                       "CLUSTERCTL_EVENT_JSON: a comma list of " + ", ".join(KINDS) + "; `end` for finished, "
                       "failed and stopped; `all` [default: the inventory's train.notify_on, else the end only].")
    @click.option("--webhook", "webhooks", metavar="URL", multiple=True,
                  help="POST every event's JSON to URL as it happens, signed with HMAC-SHA256 in "
                       f"X-Clusterctl-Signature (the secret from ${SECRET_ENV}, else the inventory's "
                       "train.webhook_secret); retried with backoff, never holding the run up. Repeatable "
                       "[default: the inventory's train.webhook].")
    @click.option("--heartbeat", type=click.FloatRange(0, 86400), default=None, metavar="SECONDS",
                  help="Send a heartbeat event this often while the run is live; 0: never [default: the "
                       "inventory's train.heartbeat, else 300 with a webhook].")
    @functools.wraps(f)
    def wrapper(*args, notify_on, webhooks, heartbeat, **kw):
        events = resolve_events(kw["opts"].load(), kw["notify"], (notify_on, tuple(webhooks), heartbeat))
        return f(*args, events=events, **kw)

    return wrapper


def resolve_events(inv, notify: str | None, flags: tuple) -> EventConfig:
    """The run's event settings, checked before anything starts (a usage error names the flag)."""
    notify_on, webhooks, heartbeat = flags
    try:
        config = EventConfig.resolve(inv.train, notify_on, webhooks, heartbeat, dict(os.environ))
    except ValueError as e:
        raise click.UsageError(f"--notify-on: {e}") from None
    if config.notify_on is not None and not (notify or inv.train.notify):
        raise click.UsageError("--notify-on says when to run the notify command: give it with --notify CMD "
                               "(or the inventory's train.notify)")
    for url in config.webhooks:
        if not url.startswith(("http://", "https://")):
            raise click.UsageError(f"--webhook {url!r}: an http:// or https:// URL")
    return config


def save_events(run: Run, notify: str | None, events: EventConfig) -> None:
    """--notify and the event settings, into the run directory before the supervisor starts."""
    save_notify(run, notify)
    save_config(run, events)
