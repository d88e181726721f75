"""Where served calls and their feedback are kept (:class:`CallStore`): one SQLite database, written by one thread
that commits in groups, so a call is durable (fsync'd) before its response is sent and a ``kill -9`` loses only
the calls still in flight."""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import sqlite3
import threading
import time
from array import array
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from envkit import Message

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    response_id TEXT NOT NULL UNIQUE,
    client TEXT NOT NULL,
    episode TEXT NOT NULL,
    segment INTEGER NOT NULL,
    created REAL NOT NULL,
    model_version INTEGER NOT NULL,
    dialect TEXT NOT NULL,
    messages TEXT NOT NULL,
    tools TEXT,
    reply TEXT NOT NULL,
    finish TEXT NOT NULL,
    context_ids BLOB NOT NULL,
    reply_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    version_spans TEXT NOT NULL,
    redacted INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS calls_client ON calls (client);
CREATE INDEX IF NOT EXISTS calls_created ON calls (created);
CREATE TABLE IF NOT EXISTS feedback (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    response_id TEXT NOT NULL REFERENCES calls (response_id) ON DELETE CASCADE,
    client TEXT NOT NULL,
    source TEXT NOT NULL,
    created REAL NOT NULL,
    score REAL NOT NULL,
    text TEXT
);
CREATE INDEX IF NOT EXISTS feedback_response ON feedback (response_id);
CREATE TABLE IF NOT EXISTS taken (
    episode TEXT PRIMARY KEY,
    round INTEGER NOT NULL,
    reward REAL
);
"""

_BATCH = 256
"""Writes committed together at most: every write waiting when a commit starts joins it (group commit)."""


@dataclass
class StoredCall:
    """One served call as kept: what the client sent and got (after redaction), and the exact tokens behind it."""

    response_id: str
    client: str
    episode: str
    """The conversation it belongs to (calls that send an earlier reply back continue its episode)."""
    segment: int
    """Which token sequence of its episode it extends (as the capture gateway links calls)."""
    model_version: int
    dialect: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    reply: Message
    finish: str
    context_ids: list[int]
    """The tokens the model read: its segment so far, this call's new messages appended."""
    reply_ids: list[int]
    """What it sampled; empty where redaction changed the reply (its text is then all that is kept)."""
    logprobs: list[float]
    version_spans: list[list[int]]
    redacted: bool = False
    """Whether the redaction hook changed anything: the ids are then the redacted chat's, rendered afresh."""
    created: float = field(default_factory=time.time)
    seq: int = 0
    """Its place in the store (assigned on write)."""


@dataclass(frozen=True)
class Feedback:
    """A score for one stored response: its client's (``source`` client) or the rubric's (``source`` rubric)."""

    response_id: str
    client: str
    source: str
    score: float
    text: str | None
    created: float


class CallStore:
    """The served calls and their feedback in ``DIR/calls.sqlite3``. Every write returns once it is committed and
    fsync'd (SQLite's WAL with ``synchronous=FULL``); writes that arrive together share one commit. Deleted rows are
    overwritten on disk (``secure_delete``) and the log is truncated after deletions, so forgotten data is gone from
    the files, not only from queries."""

    def __init__(self, directory: str | Path, *, max_age_s: float | None = None,
                 max_bytes: int | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "calls.sqlite3"
        self.max_age_s, self.max_bytes = max_age_s, max_bytes
        self._queue: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._db = self._connect()
        self._thread = threading.Thread(target=self._write_loop, name="call-store", daemon=True)
        self._thread.start()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")  # takes effect on a new database: freed pages can be returned
        for pragma in ("journal_mode = WAL", "synchronous = FULL", "secure_delete = ON", "foreign_keys = ON"):
            db.execute(f"PRAGMA {pragma}")
        db.executescript(_SCHEMA)
        return db

    def _write_loop(self) -> None:
        """Commit the writes waiting, together; a write marked ``alone`` runs by itself, outside a transaction."""
        held: _Write | None = None
        while (first := held or self._queue.get()) is not None:
            held = None
            if first.alone:
                _settle([(first.future, *_attempt(first.work, self._db))])
                continue
            batch = [first]
            while len(batch) < _BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None or item.alone:
                    held = item if item is not None else _STOP
                    break
                batch.append(item)
            _settle(self._commit(batch))
            if held is _STOP:
                break
        self._db.close()

    def _commit(self, batch: list[_Write]) -> list[tuple[Future[Any], Any, BaseException | None]]:
        try:
            self._db.execute("BEGIN IMMEDIATE")
            results = []
            for write in batch:
                self._db.execute("SAVEPOINT one")  # a write that fails is undone alone
                value, error = _attempt(write.work, self._db)
                self._db.execute("ROLLBACK TO one" if error else "RELEASE one")
                if error:
                    self._db.execute("RELEASE one")
                results.append((write.future, value, error))
            self._db.execute("COMMIT")
            return results
        except sqlite3.Error as e:
            log.error("the call store failed to commit %d writes: %s", len(batch), e)
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            return [(write.future, None, e) for write in batch]

    async def _run(self, work: Callable[[sqlite3.Connection], _T], *, alone: bool = False) -> _T:
        """``work`` on the writer thread, in a transaction (``alone``: by itself, outside one); returns once it is
        committed."""
        future: Future[_T] = Future()
        self._queue.put(_Write(work, future, alone))
        return await asyncio.wrap_future(future)

    @property
    def writer_id(self) -> int:
        """The writer thread's id in the OS (for its scheduling priority)."""
        assert self._thread.native_id is not None  # started in __init__
        return self._thread.native_id

    def close(self) -> None:
        """Commit what is queued and close; idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    async def put(self, call: StoredCall) -> int:
        """Keep ``call``; returns once it is durable, with its place in the store."""
        row = (call.response_id, call.client, call.episode, call.segment, call.created, call.model_version,
               call.dialect, json.dumps(call.messages), json.dumps(call.tools) if call.tools else None,
               json.dumps(call.reply), call.finish, array("i", call.context_ids).tobytes(),
               array("i", call.reply_ids).tobytes(), array("d", call.logprobs).tobytes(),
               json.dumps(call.version_spans), int(call.redacted))

        def insert(db: sqlite3.Connection) -> int:
            cursor = db.execute("INSERT INTO calls (response_id, client, episode, segment, created, model_version, "
                                "dialect, messages, tools, reply, finish, context_ids, reply_ids, logprobs, "
                                "version_spans, redacted) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                row)
            assert cursor.lastrowid is not None
            return cursor.lastrowid

        call.seq = await self._run(insert)
        return call.seq

    async def feedback(self, response_id: str, client: str, score: float, text: str | None = None) -> bool:
        """Record ``client``'s ``score`` for ``response_id``; False (nothing written) unless that response is stored
        and was served to ``client``: no client can score another's calls."""

        def insert(db: sqlite3.Connection) -> bool:
            owner = db.execute("SELECT client FROM calls WHERE response_id = ?", (response_id,)).fetchone()
            if owner is None or owner[0] != client:
                return False
            db.execute("INSERT INTO feedback (response_id, client, source, created, score, text) "
                       "VALUES (?, ?, 'client', ?, ?, ?)", (response_id, client, time.time(), score, text))
            return True

        return await self._run(insert)

    async def rubric_score(self, response_id: str, score: float) -> None:
        """Record the rubric's score for a stored response (one that was deleted meanwhile is skipped)."""
        await self._run(lambda db: db.execute(
            "INSERT INTO feedback (response_id, client, source, created, score) SELECT response_id, client, "
            "'rubric', ?, ? FROM calls WHERE response_id = ?", (time.time(), score, response_id)))

    def scores(self) -> dict[tuple[str, str], float]:
        """The latest score of each stored response, by (source, response id): source client or rubric."""
        with self._reader() as db:
            rows = db.execute("SELECT source, response_id, score FROM feedback ORDER BY seq").fetchall()
        return {(source, response_id): score for source, response_id, score in rows}

    async def take(self, episodes: dict[str, float | None], round_: int) -> None:
        """Mark ``episodes`` (with the reward each trained with; None: dropped unscored) as taken by ``round_``:
        no later round trains on them again, across restarts."""
        await self._run(lambda db: db.executemany("INSERT OR IGNORE INTO taken (episode, round, reward) "
                                                  "VALUES (?, ?, ?)", [(e, round_, r) for e, r in episodes.items()]))

    async def forget(self, client: str) -> int:
        """Delete every call of ``client`` and its feedback, from the files too; returns the calls deleted."""
        deleted = await self._run(lambda db: db.execute("DELETE FROM calls WHERE client = ?", (client,)).rowcount)
        await self._compact()
        return deleted

    async def prune(self) -> int:
        """Apply retention: delete calls older than ``max_age_s``, then the oldest while the data is over
        ``max_bytes``; returns the calls deleted."""

        def trim(db: sqlite3.Connection) -> int:
            deleted = 0
            if self.max_age_s is not None:
                deleted += db.execute("DELETE FROM calls WHERE created < ?", (time.time() - self.max_age_s,)).rowcount
            while self.max_bytes is not None and _data_bytes(db) > self.max_bytes:
                count = db.execute("SELECT COUNT(*) FROM calls").fetchone()[0]
                if not count:
                    break
                deleted += db.execute("DELETE FROM calls WHERE seq IN (SELECT seq FROM calls ORDER BY seq LIMIT ?)",
                                      (max(1, count // 10),)).rowcount
            return deleted

        deleted = await self._run(trim)
        if deleted:
            await self._compact()
        return deleted

    async def _compact(self) -> None:
        """Return freed pages to the file system and empty the write-ahead log (which held the deleted rows)."""

        def compact(db: sqlite3.Connection) -> None:
            db.execute("PRAGMA incremental_vacuum")
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

        await self._run(compact, alone=True)

    def calls(self, *, client: str | None = None, episode: str | None = None, after: int = 0,
              untaken: bool = False) -> list[StoredCall]:
        """The stored calls (of ``client``, of ``episode``; ``untaken``: of conversations no round has taken), in
        the order they were stored, from place ``after`` on."""
        with self._reader() as db:
            rows = db.execute("SELECT seq, response_id, client, episode, segment, created, model_version, dialect, "
                              "messages, tools, reply, finish, context_ids, reply_ids, logprobs, version_spans, "
                              "redacted FROM calls WHERE seq > ? AND (? IS NULL OR client = ?) AND "
                              "(? IS NULL OR episode = ?) AND (NOT ? OR episode NOT IN (SELECT episode FROM taken)) "
                              "ORDER BY seq", (after, client, client, episode, episode, untaken)).fetchall()
        return [StoredCall(response_id=r[1], client=r[2], episode=r[3], segment=r[4], created=r[5],
                           model_version=r[6], dialect=r[7], messages=json.loads(r[8]),
                           tools=json.loads(r[9]) if r[9] else None, reply=json.loads(r[10]), finish=r[11],
                           context_ids=list(_ints(r[12])), reply_ids=list(_ints(r[13])),
                           logprobs=list(array("d", r[14])), version_spans=json.loads(r[15]), redacted=bool(r[16]),
                           seq=r[0]) for r in rows]

    def recent(self, limit: int, *, model_version: int | None = None) -> list[StoredCall]:
        """The ``limit`` calls stored last (answered by ``model_version``), oldest first."""
        with self._reader() as db:
            after = db.execute("SELECT MIN(seq) - 1 FROM (SELECT seq FROM calls WHERE ? IS NULL OR model_version = ? "
                               "ORDER BY seq DESC LIMIT ?)", (model_version, model_version, limit)).fetchone()[0]
        calls = self.calls(after=after or 0)
        return [c for c in calls if model_version is None or c.model_version == model_version][-limit:]

    def feedbacks(self, *, client: str | None = None) -> list[Feedback]:
        """The scores received (for ``client``'s responses), oldest first."""
        with self._reader() as db:
            rows = db.execute("SELECT response_id, client, source, score, text, created FROM feedback "
                              "WHERE ? IS NULL OR client = ? ORDER BY seq", (client, client)).fetchall()
        return [Feedback(*r) for r in rows]

    def _reader(self) -> closing[sqlite3.Connection]:
        """A connection of its own for reads (the writer's is its thread's)."""
        return closing(sqlite3.connect(self.path))

    def __enter__(self) -> CallStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _Write:
    work: Callable[[sqlite3.Connection], Any]
    future: Future[Any]
    alone: bool


_STOP = _Write(lambda db: None, Future(), alone=True)
"""Held by the writer when the stop arrived mid-batch."""


def _attempt(work: Callable[[sqlite3.Connection], Any], db: sqlite3.Connection) -> tuple[Any, BaseException | None]:
    try:
        return work(db), None
    except Exception as e:  # handed to the caller that asked for the write
        return None, e


def _settle(results: list[tuple[Future[Any], Any, BaseException | None]]) -> None:
    for future, value, error in results:
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)


def _ints(blob: bytes) -> array[int]:
    return array("i", blob)


def _data_bytes(db: sqlite3.Connection) -> int:
    """The bytes the database's pages hold, free pages left out."""
    page_size, pages, free = (db.execute(f"PRAGMA {p}").fetchone()[0]
                              for p in ("page_size", "page_count", "freelist_count"))
    return (pages - free) * page_size
