"""The errors of the Kubernetes API boundary: every cluster port raises only these (kopf's errors.py idea).

The real port (`agent.kube.cluster`) turns HTTP statuses, timeouts, connection and decoding failures into the
`Api*` classes below with `raise ... from`, so callers branch on the class (or `code`), never on message text,
and behave the same against the real API server, the test double and the in-memory simulated cluster.
"""

from __future__ import annotations


class ClusterConfigError(Exception):
    """No usable kubeconfig or in-cluster service account; the message names the fix (a usage error: exit 2)."""


class ApiError(Exception):
    """The API server refused or failed a request; `code` is the HTTP status (0 when there was no response)."""

    def __init__(self, code: int, message: str = "", retry_after: float | None = None) -> None:
        super().__init__(f"{code}: {message}" if message else str(code))
        self.code = code
        self.message = message
        self.retry_after = retry_after


class ApiNotFound(ApiError):
    """404: the object does not exist (for an eviction: the pod is already gone)."""


class ApiConflict(ApiError):
    """409: a resourceVersion precondition failed or the object already exists; re-read and retry."""


class ApiGone(ApiError):
    """410: the watch resourceVersion is too old; list (or re-read) again and watch from the new version."""


class ApiTooManyRequests(ApiError):
    """429: API priority-and-fairness throttling, or a PodDisruptionBudget refusing an eviction."""


class ApiServerError(ApiError):
    """5xx; for an eviction, 500 means misconfiguration such as several PDBs selecting the pod."""


class ApiTimeout(ApiError):
    """No answer within the request timeout."""

    def __init__(self, message: str = "request timed out") -> None:
        super().__init__(0, message)


class ApiUnavailable(ApiError):
    """No connection to the API server (refused, reset, DNS)."""

    def __init__(self, message: str = "API server unreachable") -> None:
        super().__init__(0, message)


def error_for_status(code: int, message: str = "", retry_after: float | None = None) -> ApiError:
    """The exception class for an HTTP status."""
    kinds: dict[int, type[ApiError]] = {404: ApiNotFound, 409: ApiConflict, 410: ApiGone, 429: ApiTooManyRequests}
    kind = kinds.get(code, ApiServerError if code >= 500 else ApiError)
    return kind(code, message, retry_after)
