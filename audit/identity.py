"""Record identity: exact duplicates and near-duplicates, hashing content only where it can matter.

Two records are duplicates when their canonical JSON (sorted keys, no whitespace) is equal; they
are near-duplicates when they differ only in the values of timestamp keys. Digesting every record
would hash the whole corpus a second time, so each record first gets two cheap *pre-keys*
(Python hashes of its key names, of each string's length, head and tail, and of every other value's
canonical JSON): equal canonical JSON implies equal pre-keys. Only when a pre-key repeats are exact
SHA-256 digests computed, for the new record and (once, re-read from disk) for the first record
that had the pre-key. Pre-key collisions between different records therefore cost a re-read and
never a wrong answer.

The digest hashes tagged, length-prefixed pieces (s: a string's UTF-8, j: canonical JSON of any
other value) in sorted key order: near = H(pieces of non-timestamp keys, timestamp key names),
full = H(near, pieces of timestamp keys). Equal digests mean equal canonical JSON.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from kmesh_trace.audit.fields import is_timestamp_key

_ENCODE = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode
_EDGE = 32

_ts_cache: dict[str, bool] = {}


def is_timestamp_key_cached(k: str) -> bool:
    t = _ts_cache.get(k)
    if t is None:
        t = is_timestamp_key(k)
        if len(_ts_cache) < 100_000:  # keys are few in practice; bound the cache anyway
            _ts_cache[k] = t
    return t


def timestamp_keys(obj: dict) -> list[str]:
    return [k for k in obj if is_timestamp_key_cached(k)]


def canonical(v: object) -> str:
    """Canonical JSON of a parsed value: sorted keys, no whitespace, ASCII escapes."""
    try:
        return _ENCODE(v)
    except RecursionError:
        # Nesting the parser accepted but the recursive encoder cannot re-emit (it runs deeper
        # in the stack): the same text, built with an explicit stack.
        return _canonical_iterative(v)


def _canonical_iterative(v: object) -> str:
    out: list[str] = []
    stack: list[tuple[bool, object]] = [(False, v)]
    while stack:
        literal, x = stack.pop()
        if literal:
            out.append(x)
        elif type(x) is dict:
            seq: list[tuple[bool, object]] = [(True, "{")]
            for i, k in enumerate(sorted(x)):
                seq += [(True, ("," if i else "") + _ENCODE(k) + ":"), (False, x[k])]
            seq.append((True, "}"))
            stack.extend(reversed(seq))
        elif type(x) is list:
            seq = [(True, "[")]
            for i, item in enumerate(x):
                if i:
                    seq.append((True, ","))
                seq.append((False, item))
            seq.append((True, "]"))
            stack.extend(reversed(seq))
        else:
            out.append(_ENCODE(x))
    return "".join(out)


def prekeys(obj: dict, ts_keys: list[str], sorted_keys: list[str] | None = None) -> tuple[int, int]:
    """(full, near) pre-keys: cheap hashes that equal canonical JSON always shares."""
    items = []
    ts_items = []
    for k in sorted(obj) if sorted_keys is None else sorted_keys:
        v = obj[k]
        t = type(v)
        if t is str:
            sig = (k, len(v), v[:_EDGE], v[-_EDGE:])
        elif t is dict or t is list:
            sig = (k, canonical(v))
        else:
            # Numbers, booleans, null: the value itself. 1, 1.0 and true share a Python hash and
            # compare equal, so they may share a pre-key (a re-read), never split equal records.
            sig = (k, v)
        (ts_items if k in ts_keys else items).append(sig)
    near = hash((tuple(items), tuple(sorted(ts_keys))))
    return hash((near, tuple(ts_items))), near


def digests(obj: dict) -> tuple[bytes, bytes]:
    """(full, near) SHA-256 digests; equal full digests mean equal canonical JSON."""
    ts_keys = timestamp_keys(obj)
    near_h = hashlib.sha256(b"near{")
    ts_pieces = []
    for k in sorted(obj):
        v = obj[k]
        kb = k.encode("utf-8", "surrogatepass")
        if type(v) is str:
            body = v.encode("utf-8", "surrogatepass")
            head = b"%d:%b s%d:" % (len(kb), kb, len(body))
        else:
            body = canonical(v).encode("utf-8", "surrogatepass")
            head = b"%d:%b j%d:" % (len(kb), kb, len(body))
        if k in ts_keys:
            ts_pieces += (head, body)
        else:
            near_h.update(head)
            near_h.update(body)
    near_h.update(b"}" + "\x00".join(sorted(ts_keys)).encode("utf-8", "surrogatepass"))
    near = near_h.digest()
    full_h = hashlib.sha256(b"full" + near)
    for p in ts_pieces:
        full_h.update(p)
    return full_h.digest(), near


#: A record's place: (packed file:line, byte offset, byte length), enough to re-read it.
Place = tuple[int, int, int]


class RecordIndex:
    """Feed records in corpus order with `add`; read `repeats` and `near_groups` at the end."""

    def __init__(self, reread: Callable[[Place], dict]):
        self.reread = reread
        self.num_rereads = 0
        self._by_pre: dict[int, Place] = {}
        self._pre_resolved: set[int] = set()
        self._first_of: dict[bytes, int] = {}
        #: full digest -> every location holding it (first first), for records seen more than once.
        self.repeats: dict[bytes, list[int]] = {}
        self._near_by_pre: dict[int, Place] = {}
        self._near_resolved: set[int] = set()
        #: near digest -> {full digest: first location}; near-duplicates are groups of 2 or more.
        self.near_groups: dict[bytes, dict[bytes, int]] = {}
        self.near_ts_keys: dict[bytes, tuple[str, ...]] = {}

    def _digests_of(self, place: Place) -> tuple[bytes, bytes]:
        self.num_rereads += 1
        return digests(self.reread(place))

    def add(self, obj: dict, ts_keys: list[str], place: Place, sorted_keys: list[str] | None = None) -> bool:
        """Account one record; returns False when it repeats an earlier record exactly."""
        where = place[0]
        full_pre, near_pre = prekeys(obj, ts_keys, sorted_keys)
        full = near = None
        first = self._by_pre.get(full_pre)
        if first is None:
            self._by_pre[full_pre] = place
        else:
            if full_pre not in self._pre_resolved:
                self._pre_resolved.add(full_pre)
                self._first_of.setdefault(self._digests_of(first)[0], first[0])
            full, near = digests(obj)
            seen = self._first_of.get(full)
            if seen is not None:
                self.repeats.setdefault(full, [seen]).append(where)
                return False
            self._first_of[full] = where
        if not ts_keys:
            return True
        n_first = self._near_by_pre.get(near_pre)
        if n_first is None:
            self._near_by_pre[near_pre] = place
            return True
        if near_pre not in self._near_resolved:
            self._near_resolved.add(near_pre)
            f0, n0 = self._digests_of(n_first)
            self._join_near(n0, f0, n_first[0], ts_keys)
        if full is None:
            full, near = digests(obj)
        self._join_near(near, full, where, ts_keys)
        return True

    def _join_near(self, near: bytes, full: bytes, where: int, ts_keys: list[str]) -> None:
        group = self.near_groups.setdefault(near, {})
        group.setdefault(full, where)
        self.near_ts_keys.setdefault(near, tuple(sorted(ts_keys)))
