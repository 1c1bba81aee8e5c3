"""Every knob of the capture and of the hold controller: defaults, environment names, one check each.

A bad value is one clear error naming how the user set it (`KmeshTraceError`): the CLI and
`capture_in_process` refuse it before anything runs; inside an engine the plugin logs that line and
leaves the engine uncaptured (or without holds).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from kmesh_trace.capture.env import (
    DEFAULT_SHUTDOWN_GRACE_S,
    ENV_FLUSH_S,
    ENV_HOLD_EXPIRY_S,
    ENV_HOLD_MAX_BLOCKS,
    ENV_HOLD_MAX_FAMILIES,
    ENV_LINEAGE_WINDOW,
    ENV_MAX_EVENTS,
    ENV_MAX_REQUESTS,
    ENV_SHUTDOWN_GRACE_S,
)

from kmesh_trace.errors import KmeshTraceError

#: Defaults of the environment knobs (`capture/env.py`).
DEFAULTS = {"flush_interval_s": 1.0, "max_buffered_events": 1 << 19, "max_buffered_requests": 1 << 15,
            "lineage_window": 4096, "shutdown_grace_s": DEFAULT_SHUTDOWN_GRACE_S}


#: Knob -> environment variable.
ENV_NAMES = {"flush_interval_s": ENV_FLUSH_S, "max_buffered_events": ENV_MAX_EVENTS,
             "max_buffered_requests": ENV_MAX_REQUESTS, "lineage_window": ENV_LINEAGE_WINDOW,
             "shutdown_grace_s": ENV_SHUTDOWN_GRACE_S}
#: Knobs that are seconds (floats); the others are counts.
_SECONDS = ("flush_interval_s", "shutdown_grace_s", "expiry_s")
#: Knobs that may be zero (a count or a number of seconds >= 0).
_ZERO_OK = ("shutdown_grace_s",)

#: The hold controller's knobs (`hold.py`): unset means no cap / no expiry.
HOLD_ENV_NAMES = {"max_held_blocks": ENV_HOLD_MAX_BLOCKS, "max_families": ENV_HOLD_MAX_FAMILIES,
                  "expiry_s": ENV_HOLD_EXPIRY_S}


#: The longest interval a seconds knob may give (about 31 years): a wait beyond it overflows the clock.
MAX_KNOB_SECONDS = 1e9


def check_knob(key: str, value: Any, name: str) -> None:
    """Raise KmeshTraceError unless `value` is valid for knob `key`; `name` is how the user set it.

    A zero or negative flush interval would make the writer thread spin; a buffer or window below 1
    would drop every event (or forget every request) without anything looking wrong.
    """
    if key in _SECONDS:
        zero_ok = key in _ZERO_OK  # no shutdown grace is allowed; a zero flush interval would spin
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              and (value >= 0 if zero_ok else value > 0) and value <= MAX_KNOB_SECONDS)
        need = f"a number of seconds {'>= 0' if zero_ok else '> 0'} and at most {MAX_KNOB_SECONDS:,.0f}"
    else:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        need = "an integer >= 1"
    if not ok:
        raise KmeshTraceError(f"{name} must be {need}, not {value!r}.")


def config_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The capture's knobs from `environ` (this process's environment by default; defaults where unset).

    KmeshTraceError names a bad one.
    """
    return _from_env(ENV_NAMES, DEFAULTS, environ)


def hold_config_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The hold controller's knobs (None where unset), checked like the capture's."""
    return _from_env(HOLD_ENV_NAMES, dict.fromkeys(HOLD_ENV_NAMES), environ)


def _from_env(names: Mapping[str, str], defaults: Mapping[str, Any], environ: Mapping[str, str] | None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    config = {}
    for key, env in names.items():
        raw = environ.get(env)
        if raw in (None, ""):
            config[key] = defaults[key]
            continue
        try:
            value = float(raw) if key in _SECONDS else int(raw)
        except ValueError:
            value = raw
        check_knob(key, value, env)
        config[key] = value
    return config


