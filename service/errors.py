"""The session errors, domain errors: the session table (``service/sessions/``) raises
them, the conversation passes them on, and the fronts map them (``service.wire``'s
status table, ``service.http.openai``'s HTTP errors) without importing the sessions.
``SESSION_ID_RE`` is what a session id is (the Responses API checks a response id by it).
Imports nothing of kvserve."""

from __future__ import annotations

import re

SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class SessionError(Exception):
    """Base of the session table's errors; ``service.wire`` maps each to a status."""


class SessionNotFound(SessionError):
    """No such session for this owner (NOT_FOUND)."""


class SessionDeleted(SessionNotFound):
    """The session was deleted (DeleteSession) while this turn held it: the turn ends
    and nothing of it is recorded (NOT_FOUND)."""


class SessionBusy(SessionError):
    """The session has a turn in flight (FAILED_PRECONDITION)."""


class InvalidSessionId(SessionError):
    """The id is not 1-128 characters of [A-Za-z0-9._:-] (INVALID_ARGUMENT)."""


class SessionConflict(SessionError):
    """Another replica wrote the session while this turn ran; the turn is not recorded
    (FAILED_PRECONDITION)."""


class SessionLimit(SessionError):
    """The owner already holds ``max_sessions_per_owner`` sessions (RESOURCE_EXHAUSTED)."""


class SessionExists(SessionError):
    """A session with that id already exists for this owner (ALREADY_EXISTS)."""


class BadTurnCount(SessionError):
    """A turn count or turn index outside the session's turns (INVALID_ARGUMENT)."""


class TurnUnavailable(SessionError):
    """The turn an operation needs is not there: the session has no completed turn to
    replace, or the turn was written before turn boundaries were recorded
    (FAILED_PRECONDITION)."""


class TurnsChanged(SessionError):
    """The session does not have the number of completed turns the request expected
    (``expected_turns``): another turn or operation changed it (FAILED_PRECONDITION)."""


class SessionStoreUnavailable(SessionError):
    """The session store could not save a change (the disk store's file, or, with Redis
    away, the journal, failed to write): the call fails before it is acknowledged and the
    session stays as it was (UNAVAILABLE; retry)."""
