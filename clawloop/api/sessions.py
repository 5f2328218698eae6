"""Sessions: which conversation a request belongs to, and pairing each stored turn with its next state.

Identification. A request names its session by the path prefix ``/sessions/{id}/v1/...``, the header
``X-Session-Id`` or the body field ``session_id`` (first found wins, in that order). A request naming none is
matched by conversation prefix: every session remembers the hash of its last main turn's request messages
followed by the answer it got; a request whose messages start with such a prefix continues that session (the
longest matching prefix wins), anything else opens a new session with a generated id (``sess_<hex>``). Hashes
are chained over a canonical form of each message (role, stripped text, tool calls as name + re-serialised
arguments; call ids and other client decorations are ignored; an answer's text without client envelopes, see
"Rewritten answers" below), so one pass over the messages gives the hash of
every prefix. Each session is indexed under two keys: the exact one, and one that ignores system messages (so
an agent whose system prompt changes between turns, e.g. with the date in it, still continues its session);
the exact key wins at equal length. A request that matches no such prefix but starts with a pending turn's exact
request messages followed by a *trimmed echo* of its answer (``is_trimmed_echo``: the same tool calls, and text
whose words are the stored answer's with some left out, as when OpenClaw removes a ``<think>`` block or a reply tag
clawloop has no rule for, or pieces of it in order around OpenClaw's "…", where its compaction cut the middle out
of a long answer, possibly inside a word) continues that session too, unless the echo fits the pending turns of
several sessions that opened alike: then it continues none. An answer the client left out, or one with words the
model never wrote, matches nothing by its request: pairing it would judge an answer by a reply to another, and two
conversations with the same opening (same system prompt, same first message) would take each other's turns.
The index holds three keys per live session and one request key per pending turn (none for a request of
ephemeral messages only), so it is bounded by ``max_sessions``.

Pairing. A session has at most one *pending* turn: the last stored main turn, awaiting its next state. The
next main request of the session supplies it, before that request is generated:

1. its messages start with the pending turn's messages + answer (or its trimmed echo): the next state is
   everything after them. OpenClaw asking again for an answer the user can see (``openclaw_format.asks_again``;
   its retry message is ephemeral) finds the session by the pending turn's exact request alone, and the pending
   turn, which the user never saw, is dropped as ``regenerated``;
2. otherwise (the client trimmed or rewrote older history) the answer is searched for, last occurrence first;
   the next state is everything after it;
3. otherwise, when the messages equal the pending turn's own request, the client asked again for the same
   context: the pending turn is dropped with reason ``regenerated``;
4. otherwise the trailing run of non-assistant messages is the next state (counted as ``fallback``).

An empty next state drops the turn with reason ``empty_next_state``. A turn paired this way moves to
``judgeable`` and the ``on_judgeable(turn_id)`` hook runs (sync or async; never awaited on the request path).

Main requests of one session are serialised by a per-session lock held from pairing until the new turn is
committed, so each turn's next state is well-defined. A prefix-matched request re-checks its match under the
lock; if another request continued the session first, the request forks into a new session. Side requests
take no lock and change no state: they are served and counted only.

Ending. ``X-Session-Done`` / ``session_done`` (after the request is served), ``POST /v1/sessions/{id}/end``,
the idle timeout (a background sweeper) and eviction beyond ``max_sessions`` all end a session: its pending turn
is dropped with reason ``no_next_state`` (recorded, never silent) and its state is forgotten.

A session that has never stored a turn lives only while a request holds it: when the last request holding it
lets go without committing (the client left, the engine failed, the disk was full), it is forgotten at once
(counted as ended ``unused``). Nothing refers to it (prefix keys only exist for stored answers), so nothing is
lost, and a request that stored nothing leaves no trace in the session table.

Ownership. With per-user keys every session belongs to the key that opened it (its *owner*, a fingerprint of the
key, stored with each turn): sessions are looked up under (owner, id), so another key naming the same id gets a
session of its own, and prefix matching only looks among the caller's sessions. Without per-user keys the
owner is ``""`` and every client shares one namespace (docs/security.md).

Limit and eviction. ``max_sessions`` bounds the live sessions in memory, all owners together. Eviction runs when
a turn is stored (a request that stores nothing never pushes anyone out) and, while more than ``max_sessions``
are live, ends the least recently used idle session *of the owner holding the most live sessions*; when the
storing request's own owner is among those holding the most, its own session goes. So an owner who fills the
table (a key at the limit) only ever ends its own sessions, another owner loses a session only while holding
more than the owner whose turn was stored, and with one owner (no per-user keys, owner ``""``) this is plain
least-recently-used eviction over the shared namespace. When every session of the owner to evict from is busy
(a request in flight), the table overshoots until a later commit; it never takes from a smaller owner instead.
Eviction runs after the new turn is stored: when ending the victim cannot be written (disk full), the victim
stays live, the error is logged, and the next commit tries again.

Faults. The store is written before memory changes: a pairing, a drop or an end whose store write fails (disk
full) leaves the session exactly as it was, and the request fails with the error.

Ephemeral messages. Matching and pairing see a request's messages without the ones
``openclaw_format.conversation_messages`` removes (a client's per-request context block that its next request
drops from the history), so such a block neither breaks the prefix match nor becomes part of a next state. The
stored turn keeps the messages exactly as the model saw them. A request whose older history the client compacted
into a summary (``openclaw_format.is_compacted_history``) matches no prefix; it continues the session whose pending
answer is its last assistant message (each session is also indexed by its pending answer alone).

Rewritten answers. A client can send an answer back changed: a model that sees OpenClaw's timestamp envelope on
every user message starts its own answers with one (``[Wed 2026-11-25 22:30:22] …``), and OpenClaw removes it
from the history it sends next. Assistant messages are therefore compared by their text without client envelopes
(``clawloop.openclaw_format.strip_text``, the very normalisation the judge reads user text with), in the prefix
keys, the answer search and the answer key alike; user, tool and system messages compare as sent. The stored turn
keeps the answer exactly as the model wrote it.

Restart. ``restore()`` rebuilds live sessions from the store's ``awaiting_next`` turns (latest per session;
older ones of the same session are dropped as ``no_next_state``), including their prefix keys, so a restart
loses no pairing. Beyond ``max_sessions`` the same rule as eviction picks what is dropped (the oldest turn of the
owner holding the most). Their idle clock starts again at restore time. Shutdown leaves pending turns awaiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import logging
import re
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from clawloop.openclaw_format import (TRUNCATION_MARK, asks_again, conversation_messages, is_compacted_history,
                                      strip_text)
from clawloop.store import Store, TurnRecord, TurnState

log = logging.getLogger("clawloop.sessions")

NO_NEXT_STATE = "no_next_state"
CLIENT_CLOSED = "client_closed_request"
"""Drop reason of a turn whose request was cancelled (its client left) while the turn was being written."""
REGENERATED = "regenerated"
EMPTY_NEXT_STATE = "empty_next_state"

JudgeableHook = Callable[[int], Any]


# --------------------------------------------------------------------------------------------- hashing


def canonical_message(msg: dict[str, Any]) -> dict[str, Any]:
    """The parts of a message that decide whether two messages are 'the same' for session matching."""
    role = msg.get("role", "")
    text = msg.get("content") or ""
    # A client may send an answer back rewritten: OpenClaw removes the timestamp envelope a model imitates at the
    # start of its answer. Answers therefore compare without client envelopes, removed exactly as for the judge.
    out: dict[str, Any] = {"r": role, "c": strip_text(text) if role == "assistant" else text.strip()}
    calls = []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function", {})
        args = fn.get("arguments", "")
        try:
            args = json.dumps(json.loads(args), sort_keys=True, ensure_ascii=False) if args.strip() else "{}"
        except (ValueError, TypeError, AttributeError, RecursionError):
            args = str(args).strip()
        calls.append([fn.get("name", ""), args])
    if calls:
        out["t"] = calls
    return out


def prefix_hashes(messages: list[dict[str, Any]], skip_system: bool = False) -> list[str]:
    """hashes[k] identifies messages[:k+1]; chained so all prefixes cost one pass. With ``skip_system`` system
    messages leave the hash unchanged (a second, looser key for agents that rewrite their system prompt)."""
    hashes = []
    h = ""
    for msg in messages:
        if not (skip_system and msg.get("role") == "system"):
            blob = json.dumps(canonical_message(msg), sort_keys=True, ensure_ascii=False)
            h = hashlib.sha256((h + "\x00" + blob).encode("utf-8")).hexdigest()
        hashes.append(h)
    return hashes


def prefix_keys(messages: list[dict[str, Any]]) -> tuple[str, str]:
    """(exact key, key ignoring system messages) of a whole message list."""
    return prefix_hashes(messages)[-1], "nosys:" + prefix_hashes(messages, skip_system=True)[-1]


def request_key(messages: list[dict[str, Any]]) -> str:
    """Index key of a turn's exact request messages alone (its answer came back trimmed, or asked for again)."""
    return "request:" + prefix_hashes(messages)[-1]


def is_trimmed_echo(echo: dict[str, Any], answer: dict[str, Any]) -> bool:
    """True when ``echo``, an assistant message a client sent back, is ``answer`` with parts left out: the same
    tool calls, and text (envelopes removed) whose words are some of the answer's, in order: at least one, or at
    least one tool call. Text cut with a truncation mark also counts when the pieces around the marks are found in
    the answer's text, verbatim and in order, since such a cut may split a word."""
    if echo.get("role") != "assistant":
        return False
    shown, written = canonical_message(echo), canonical_message(answer)
    if shown.get("t") != written.get("t"):
        return False
    kept = re.findall(r"\w+", shown["c"])
    remaining = iter(re.findall(r"\w+", written["c"]))
    if bool(kept or shown.get("t")) and all(word in remaining for word in kept):
        return True
    return TRUNCATION_MARK in shown["c"] and pieces_in_order(shown["c"].split(TRUNCATION_MARK), written["c"])


def pieces_in_order(pieces: list[str], text: str) -> bool:
    """Each non-blank piece (trimmed) occurs in ``text`` after the previous one; at least one piece has a word."""
    found, start = False, 0
    for piece in (p.strip() for p in pieces):
        if not piece:
            continue
        at = text.find(piece, start)
        if at < 0:
            return False
        start, found = at + len(piece), found or re.search(r"\w", piece) is not None
    return found


def answer_key(answer: dict[str, Any]) -> str:
    """Index key of an answer alone (compacted histories keep only the answer of the previous turn)."""
    return "answer:" + prefix_hashes([answer])[-1]


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return canonical_message(a) == canonical_message(b)


class OwnerClosed(RuntimeError):
    """A main request of an owner whose records are being forgotten (``owner_closed``)."""

    def __init__(self, owner: str):
        super().__init__(f"requests of {owner!r} are closed while their records are forgotten")


@dataclass
class Pairing:
    next_state: list[dict[str, Any]] | None
    """The messages after the stored answer; None when the turn must be dropped (see ``drop_reason``)."""
    how: str
    """prefix, request, search, fallback, regenerated or empty."""
    drop_reason: str = ""


def find_next_state(pending_messages: list[dict[str, Any]], answer: dict[str, Any],
                    messages: list[dict[str, Any]]) -> Pairing:
    """Split ``messages`` (a later request of the session) into history and the pending turn's next state."""
    n = len(pending_messages)
    if len(messages) > n and prefix_keys(messages[: n + 1])[0] == prefix_keys(pending_messages + [answer])[0]:
        rest = messages[n + 1:]
        return Pairing(rest, "prefix") if rest else Pairing(None, "empty", EMPTY_NEXT_STATE)
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant" and same_message(messages[i], answer):
            rest = messages[i + 1:]
            return Pairing(rest, "search") if rest else Pairing(None, "empty", EMPTY_NEXT_STATE)
    if len(messages) == n and prefix_hashes(messages) == prefix_hashes(pending_messages):
        return Pairing(None, "regenerated", REGENERATED)
    k = len(messages)
    while k > 0 and messages[k - 1].get("role") != "assistant":
        k -= 1
    rest = messages[k:]
    return Pairing(rest, "fallback") if rest else Pairing(None, "empty", EMPTY_NEXT_STATE)


# -------------------------------------------------------------------------------------------- sessions


@dataclass
class PendingTurn:
    turn_id: int
    messages: list[dict[str, Any]]
    answer: dict[str, Any]


@dataclass
class Session:
    id: str
    last_seen: float
    owner: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    turn_index: int = 0
    pending: PendingTurn | None = None
    last_turn_id: int | None = None
    prefix_keys: tuple[str, ...] = ()
    request_key: str = ""
    """Its pending turn's request key (in its owner's namespace), or "" when it has none."""
    ended: bool = False
    holders: int = 0
    """Requests holding the session's lock or waiting for it (a session nobody holds may be forgotten)."""


def new_session_id() -> str:
    return f"sess_{uuid.uuid4().hex}"


def session_key(owner: str, session_id: str) -> str:
    """Where a session lives in memory: its id within its owner's namespace."""
    return f"{owner}\x1f{session_id}" if owner else session_id


def turns_beyond_limit(turns: list[TurnRecord], limit: int) -> list[TurnRecord]:
    """Which of these pending turns (one per session, oldest first) to drop so that ``limit`` remain: one at a time,
    the oldest turn of the owner holding the most (on a tie, the owner whose oldest turn is oldest), as eviction
    chooses."""
    by_owner: dict[str, deque[TurnRecord]] = {}
    for t in turns:
        by_owner.setdefault(t.owner, deque()).append(t)
    dropped = []
    for _ in range(max(0, len(turns) - limit)):
        owner = max(by_owner, key=lambda o: (len(by_owner[o]), -by_owner[o][0].id))
        dropped.append(by_owner[owner].popleft())
        if not by_owner[owner]:
            del by_owner[owner]
    return dropped


class TurnContext:
    """A main request's hold on its session: created locked and paired; ``commit`` stores the new turn;
    ``release`` (always called, exactly once) unlocks, and forgets the session if it has never stored a turn."""

    def __init__(self, manager: "SessionManager", session: Session, how: str):
        self.manager = manager
        self.session = session
        self.how = how
        """How the session was found: explicit, prefix, request (a trimmed echo), again (asked again), new, or
        fork."""
        self.paired_turn_id: int | None = None
        """The session's previous turn, if this request gave it its next state."""
        self._released = False

    @property
    def session_id(self) -> str:
        return self.session.id

    @property
    def turn_index(self) -> int:
        return self.session.turn_index

    async def commit(self, turn: TurnRecord) -> int:
        """Store the turn (durably, before the answer is returned) and make it the session's pending turn."""
        return await self.manager._commit(self.session, turn)

    async def end_session(self) -> None:
        await self.manager._end_locked(self.session, "done")

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.manager._let_go(self.session)


class SessionManager:
    def __init__(self, store: Store, max_sessions: int = 10000, idle_timeout_s: float = 900.0,
                 on_judgeable: JudgeableHook | None = None, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.on_judgeable = on_judgeable
        self.clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.closed_owners: set[str] = set()
        """Owners who can start no request now (``owner_closed``)."""
        self._forgets: Counter[str] = Counter()
        """How many forgets of each owner have begun (``arrival``)."""
        self._live_by_owner: Counter[str] = Counter()
        self._prefix: dict[str, tuple[str, int]] = {}
        """prefix key -> (session id, turn id) of the turn that ended with that answer."""
        self._requests: dict[str, set[str]] = {}
        """request key -> the ids of the sessions whose pending turn has that exact request (several when
        conversations open alike)."""
        self.stats: Counter[str] = Counter()
        self._tasks: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None

    # ---- queries -----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str, owner: str = "") -> Session | None:
        return self._sessions.get(session_key(owner, session_id))

    def pending_turn_id(self, session_id: str, owner: str = "") -> int | None:
        s = self.get(session_id, owner)
        return None if s is None or s.pending is None else s.pending.turn_id

    def live_count(self, owner: str) -> int:
        """How many sessions ``owner`` has in memory."""
        return self._live_by_owner.get(owner, 0)

    # ---- lifecycle -----------------------------------------------------------------------------------------
    async def restore(self) -> int:
        """Rebuild sessions from awaiting_next turns in the store (see module docstring). Returns how many."""
        turns = await asyncio.to_thread(self.store.turns, TurnState.AWAITING_NEXT)
        latest: dict[str, TurnRecord] = {}
        for t in turns:  # ordered by id, so the last one per session wins
            key = session_key(t.owner, t.session_id)
            older = latest.get(key)
            if older is not None:
                await asyncio.to_thread(self.store.drop_turn, older.id, NO_NEXT_STATE)
            latest[key] = t
        pending = sorted(latest.values(), key=lambda t: t.id)
        overflow = turns_beyond_limit(pending, self.max_sessions)
        for t in overflow:
            await asyncio.to_thread(self.store.drop_turn, t.id, NO_NEXT_STATE)
        dropped_ids = {t.id for t in overflow}
        keep = [t for t in pending if t.id not in dropped_ids]
        now = self.clock()
        for t in keep:
            s = Session(id=t.session_id, last_seen=now, owner=t.owner, turn_index=t.turn_index + 1,
                        last_turn_id=t.id)
            self._add(s)
            self._set_pending(s, PendingTurn(t.id, t.messages, t.assistant_message))
        self.stats["restored"] += len(keep)
        return len(keep)

    def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
            self._sweeper = None
        while self._tasks:  # a task may start another (a write the client left, then its drop)
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _sweep_forever(self) -> None:
        interval_s = max(0.05, min(self.idle_timeout_s / 4.0, 10.0))
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sweep_idle()
            except Exception:  # the sweeper must survive a store hiccup
                log.exception("idle session sweep failed")

    async def sweep_idle(self) -> int:
        """End every session idle for longer than the timeout (sessions with a request in flight are busy)."""
        cutoff = self.clock() - self.idle_timeout_s
        idle = [s for s in self._sessions.values() if s.last_seen < cutoff and not s.lock.locked()]
        ended = 0
        for s in idle:
            if s.lock.locked():  # a request took it since the list was made: busy now, and it may hold it long
                continue
            async with s.lock:  # free, so taken at once: nothing can come between the check and this
                if s.last_seen < cutoff and not s.ended:  # still idle once we hold it
                    await self._end_locked(s, "idle")
                    ended += 1
        return ended

    # ---- resolution --------------------------------------------------------------------------------------
    def _add(self, s: Session) -> None:
        self._sessions[session_key(s.owner, s.id)] = s
        self._live_by_owner[s.owner] += 1

    def _touch(self, session_id: str, owner: str = "") -> Session:
        key = session_key(owner, session_id)
        s = self._sessions.get(key)
        if s is None:
            s = Session(id=session_id, last_seen=self.clock(), owner=owner)
            self._add(s)
            self.stats["sessions_started"] += 1
        else:
            self._sessions.move_to_end(key)
        s.last_seen = self.clock()
        return s

    async def _hold(self, s: Session) -> None:
        """Lock ``s`` for a request (counted as a holder while it waits, so it is not forgotten under it)."""
        s.holders += 1
        try:
            await s.lock.acquire()
        except BaseException:  # cancelled while waiting: it holds nothing
            s.holders -= 1
            self._forget_if_unused(s)
            raise

    def _let_go(self, s: Session) -> None:
        """A request is done with ``s`` (whose lock it holds): unlock it, and forget it if it stored nothing."""
        s.holders -= 1
        s.last_seen = self.clock()
        if s.lock.locked():
            s.lock.release()
        self._forget_if_unused(s)

    def _forget_if_unused(self, s: Session) -> None:
        # turn_index counts the turns stored in the session (restored sessions start past their stored turn), so 0
        # means it holds nothing: no pending turn, no prefix keys, nothing for a later request to continue.
        if s.holders == 0 and s.turn_index == 0 and not s.ended:
            self._forget(s, "unused")

    def match_prefix(self, messages: list[dict[str, Any]], owner: str = "") -> tuple[str, int, int] | None:
        """(session id, turn id, messages consumed) of the longest prefix that is the last turn of one of
        ``owner``'s sessions; at equal length an exact match beats one that ignores system messages."""
        exact = prefix_hashes(messages)
        loose = prefix_hashes(messages, skip_system=True)
        for k in range(len(messages), 0, -1):
            if messages[k - 1].get("role") != "assistant":
                continue
            for key in (exact[k - 1], "nosys:" + loose[k - 1]):
                hit = self._prefix.get(session_key(owner, key))
                if hit is not None and session_key(owner, hit[0]) in self._sessions:
                    return hit[0], hit[1], k
        return None

    def match_request(self, messages: list[dict[str, Any]], owner: str = "",
                      again: bool = False) -> tuple[str, int, int, str] | None:
        """Like ``match_prefix``, by the longest prefix that is a pending turn's exact request followed by a
        trimmed echo of its answer (consumed with it; found ``request``); with ``again`` (the client asks again
        for the same context) also by ``messages`` that are that request and nothing more (found ``again``).
        Where several sessions' pending turns fit (conversations that opened alike, a short echo), nothing does:
        the request opens a session of its own rather than take a turn that may be another conversation's."""
        exact = prefix_hashes(messages)
        for k in range(len(messages), 0, -1):
            fits = []
            for sid in self._requests.get(session_key(owner, "request:" + exact[k - 1]), ()):
                s = self._sessions[session_key(owner, sid)]
                if k < len(messages) and is_trimmed_echo(messages[k], s.pending.answer):
                    fits.append((sid, s.pending.turn_id, k + 1, "request"))
                elif k == len(messages) and again:
                    fits.append((sid, s.pending.turn_id, k, "again"))
            if fits:
                return fits[0] if len(fits) == 1 else None
        return None

    def match_answer(self, messages: list[dict[str, Any]], owner: str = "") -> tuple[str, int, int] | None:
        """Like ``match_prefix``, by the last assistant message alone (for compacted histories)."""
        k = len(messages)
        while k > 0 and messages[k - 1].get("role") != "assistant":
            k -= 1
        hit = self._prefix.get(session_key(owner, answer_key(messages[k - 1]))) if k else None
        if hit is not None and session_key(owner, hit[0]) in self._sessions:
            return hit[0], hit[1], k
        return None

    def resolve_side(self, explicit_id: str | None, messages: list[dict[str, Any]], owner: str = "") -> str:
        """Session id reported for a side request; creates no state."""
        if explicit_id is not None:
            s = self.get(explicit_id, owner)
            if s is not None:
                s.last_seen = self.clock()
            sid = explicit_id
        else:
            hit = self.match_prefix(conversation_messages(messages), owner)
            sid = hit[0] if hit else new_session_id()
        self.stats["side_turns"] += 1
        return sid

    def _find_main(self, explicit_id: str | None, messages: list[dict[str, Any]], owner: str,
                   again: bool) -> tuple[Session, str, int | None, int | None]:
        """(session, how it was found, messages consumed by a prefix match, the turn that match ended with)."""
        if explicit_id is not None:
            return self._touch(explicit_id, owner), "explicit", None, None
        hit, how = self.match_prefix(messages, owner), "prefix"
        if hit is None and is_compacted_history(messages):
            hit = self.match_answer(messages, owner)
        if hit is None:
            found = self.match_request(messages, owner, again=again)
            if found is not None:
                hit, how = found[:3], found[3]
        if hit is None:
            return self._touch(new_session_id(), owner), "new", None, None
        return self._touch(hit[0], owner), how, hit[2], hit[1]

    async def begin_main(self, explicit_id: str | None, messages: list[dict[str, Any]],
                         owner: str = "", arrived: int | None = None) -> TurnContext:
        """Find (or open) ``owner``'s session of a main request, lock it, and pair its pending turn. ``arrived``:
        the request's ``arrival``; ``OwnerClosed`` when a forget of ``owner`` has begun since, or is under way."""
        again = asks_again(messages)
        messages = conversation_messages(messages)
        while True:
            session, how, consumed, matched_turn = self._find_main(explicit_id, messages, owner, again)
            await self._hold(session)
            if session.ended:  # ended while we waited for it: start over with a fresh session
                self._let_go(session)
                continue
            if self.is_closed(owner) or (arrived is not None and arrived != self._forgets[owner]):
                # A forget of the owner began after the route's own check (during the body read, the template):
                # it waits only for requests that held a session before, so this one stores nothing.
                self._let_go(session)
                raise OwnerClosed(owner)
            if how in ("prefix", "request", "again") and session.last_turn_id != matched_turn:
                # Someone continued this session from the same point first: this request branches off.
                self._let_go(session)
                session, how, consumed = self._touch(new_session_id(), owner), "fork", None
                await self._hold(session)
            ctx = TurnContext(self, session, how)
            try:
                await self._pair(ctx, messages, consumed, how)
            except BaseException:
                ctx.release()
                raise
            self.stats["main_turns"] += 1
            return ctx

    async def _pair(self, ctx: TurnContext, messages: list[dict[str, Any]], consumed: int | None,
                    how: str) -> None:
        s = ctx.session
        pending = s.pending
        if pending is None:
            return
        if how == "again":
            pairing = Pairing(None, "regenerated", REGENERATED)
        elif consumed is not None:
            rest = messages[consumed:]
            pairing = Pairing(rest, how) if rest else Pairing(None, "empty", EMPTY_NEXT_STATE)
        else:
            pairing = find_next_state(conversation_messages(pending.messages), pending.answer, messages)
        # Store first: when the write fails (disk full) the pending turn stays, and a retry pairs it again.
        if pairing.next_state is None:
            await asyncio.to_thread(self.store.drop_turn, pending.turn_id, pairing.drop_reason)
            self._clear_pending(s)
            self.stats[f"pairing_{pairing.how}"] += 1
            return
        ok = await asyncio.to_thread(self.store.set_next_state, pending.turn_id, pairing.next_state)
        self._clear_pending(s)
        self.stats[f"pairing_{pairing.how}"] += 1
        if ok:
            ctx.paired_turn_id = pending.turn_id
            self._fire_judgeable(pending.turn_id)

    def _fire_judgeable(self, turn_id: int) -> None:
        if self.on_judgeable is None:
            return
        try:
            result = self.on_judgeable(turn_id)
            if inspect.isawaitable(result):
                task = asyncio.ensure_future(result)
                self._tasks.add(task)
                task.add_done_callback(self._hook_done)
        except Exception:
            log.exception("on_judgeable hook failed for turn %s", turn_id)

    def _drop_abandoned(self, writing: asyncio.Future) -> None:
        self._tasks.discard(writing)
        if writing.cancelled() or writing.exception() is not None:
            return  # nothing was stored
        task = asyncio.ensure_future(asyncio.to_thread(self.store.drop_turn, writing.result(), CLIENT_CLOSED))
        self._tasks.add(task)
        task.add_done_callback(self._hook_done)
        self.stats["turns_dropped_client_closed"] += 1

    def _hook_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("on_judgeable hook failed", exc_info=task.exception())

    # ---- commit / end -------------------------------------------------------------------------------------
    def _set_pending(self, s: Session, pending: PendingTurn) -> None:
        self._clear_pending(s)
        s.pending = pending
        self._drop_keys(s)
        request = conversation_messages(pending.messages)
        s.prefix_keys = tuple(session_key(s.owner, k) for k in
                              prefix_keys(request + [pending.answer]) + (answer_key(pending.answer),))
        if request:  # a request of ephemeral messages only has no key of its own
            s.request_key = session_key(s.owner, request_key(request))
            self._requests.setdefault(s.request_key, set()).add(s.id)
        for key in s.prefix_keys:
            self._prefix[key] = (s.id, pending.turn_id)

    def _drop_keys(self, s: Session) -> None:
        for key in s.prefix_keys:
            if self._prefix.get(key, ("",))[0] == s.id:
                del self._prefix[key]
        s.prefix_keys = ()
        self._drop_request_key(s)

    def _drop_request_key(self, s: Session) -> None:
        sessions = self._requests.get(s.request_key)
        if sessions is not None:
            sessions.discard(s.id)
            if not sessions:
                del self._requests[s.request_key]
        s.request_key = ""

    def _clear_pending(self, s: Session) -> None:
        # The prefix keys stay while the session lives (a retried continuation still finds the session by its
        # prefix); the next commit replaces them and ending the session removes them. The request key goes with
        # the pending turn: it only ever leads to a pending turn.
        s.pending = None
        self._drop_request_key(s)

    async def _commit(self, s: Session, turn: TurnRecord) -> int:
        turn.session_id = s.id
        turn.owner = s.owner
        turn.turn_index = s.turn_index
        writing = asyncio.ensure_future(asyncio.to_thread(self.store.add_turn, turn))
        try:
            turn_id = await asyncio.shield(writing)
        except asyncio.CancelledError:
            # The client left while the turn was being written (the stream is cancelled): the write goes on in its
            # thread, but the answer never reached the client, so the stored turn is dropped, never left awaiting
            # a next state that no session will bring.
            self._tasks.add(writing)
            writing.add_done_callback(self._drop_abandoned)
            raise
        s.turn_index += 1
        s.last_turn_id = turn_id
        self._set_pending(s, PendingTurn(turn_id, turn.messages, turn.assistant_message))
        s.last_seen = self.clock()
        self.stats["turns_stored"] += 1
        await self._make_room(s)
        return turn_id

    async def _end_locked(self, s: Session, why: str) -> int | None:
        """End a session whose lock the caller holds (or that is idle). Returns the dropped turn id."""
        if s.ended:
            return None
        dropped = None
        if s.pending is not None:  # store first: a failed write leaves the session live and unchanged
            dropped = s.pending.turn_id
            await asyncio.to_thread(self.store.drop_turn, dropped, NO_NEXT_STATE)
            s.pending = None
            self.stats["turns_dropped_no_next_state"] += 1
        self._forget(s, why)
        return dropped

    def _forget(self, s: Session, why: str) -> None:
        """Take an ended session out of memory (its pending turn, if any, was dropped in the store first)."""
        s.ended = True
        key = session_key(s.owner, s.id)
        if self._sessions.get(key) is s:
            del self._sessions[key]
            self._live_by_owner[s.owner] -= 1
            if not self._live_by_owner[s.owner]:
                del self._live_by_owner[s.owner]
        self._drop_keys(s)
        self.stats[f"sessions_ended_{why}"] += 1

    async def _end_unlocked(self, s: Session, why: str) -> int | None:
        async with s.lock:
            return await self._end_locked(s, why)

    async def end(self, session_id: str, owner: str = "") -> tuple[bool, int | None]:
        """End ``owner``'s session by id (waits for its in-flight main request). (known, dropped turn id)."""
        s = self.get(session_id, owner)
        if s is None:
            return False, None
        return True, await self._end_unlocked(s, "request")

    async def end_owner(self, owner: str, why: str = "forgotten") -> int:
        """End every live session of ``owner`` (each after its in-flight main request); returns how many."""
        ended = 0
        for s in [s for s in self._sessions.values() if s.owner == owner]:
            await self._end_unlocked(s, why)
            ended += 1
        return ended

    def arrival(self, owner: str) -> int:
        """What a request of ``owner`` notes when it passes the route's ``is_closed`` check, before its body is
        read: ``begin_main`` refuses it if a forget of ``owner`` began since, however long its body took to arrive
        (a forget never waits for requests still on their way, which a client sending its body slowly would make
        it do for as long as it liked)."""
        return self._forgets[owner]

    @contextlib.asynccontextmanager
    async def owner_closed(self, owner: str) -> AsyncIterator[int]:
        """While the block runs ``owner`` can start no request (``is_closed``; the chat route answers 409) and
        none of their sessions is live: every session is ended, each after its request in flight (yields how
        many), and a request already on its way is refused when it reaches its session (``arrival``). For a
        forget, so that no turn of theirs is stored while, or after, their records are deleted."""
        self._forgets[owner] += 1
        self.closed_owners.add(owner)
        try:
            yield await self.end_owner(owner)
        finally:
            self.closed_owners.discard(owner)

    def is_closed(self, owner: str) -> bool:
        return owner in self.closed_owners

    async def end_if_exists(self, session_id: str, why: str, owner: str = "") -> None:
        s = self.get(session_id, owner)
        if s is not None:
            await self._end_unlocked(s, why)

    # ---- eviction (see "Limit and eviction" in the module docstring) ---------------------------------------
    def _eviction_victim(self, storing: Session) -> Session | None:
        """The least recently used idle session of the owner holding the most live sessions (``storing``'s owner
        on a tie); None when all of that owner's sessions are busy."""
        most = max(self._live_by_owner.values())
        if self._live_by_owner[storing.owner] == most:
            may_lose = {storing.owner}
        else:
            may_lose = {owner for owner, n in self._live_by_owner.items() if n == most}
        for s in self._sessions.values():  # least recently used first
            if s.owner in may_lose and s is not storing and s.holders == 0 and not s.lock.locked():
                return s
        return None

    async def _evict_beyond_limit(self, storing: Session) -> None:
        while len(self._sessions) > self.max_sessions:
            victim = self._eviction_victim(storing)
            if victim is None:
                return  # the owner to take from is busy: allow the overshoot until one of its requests finishes
            await self._end_unlocked(victim, "evicted")

    async def _make_room(self, storing: Session) -> None:
        """Evict after ``storing`` stored a turn; that turn stands whatever happens here."""
        try:
            await self._evict_beyond_limit(storing)
        except Exception:  # e.g. disk full while dropping the victim's turn: it stays live, the next commit retries
            log.exception("evicting sessions beyond max_sessions failed")
