"""Cloud spot-preemption notice sources (AWS, GCP, Azure metadata) and the thread that polls them."""

from __future__ import annotations

import email.utils
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Protocol, runtime_checkable

from lightning_bamboo.errors import BambooConfigError, BambooError

log = logging.getLogger(__name__)

__all__ = [
    "AwsSpotPoller",
    "AzureScheduledEventsPoller",
    "GcpPreemptionPoller",
    "Notice",
    "NoticePoller",
    "NoticeSourceError",
    "NoticeWatcher",
]


@dataclass(frozen=True)
class Notice:
    """This process's machine is going away.

    ``source`` names where the notice came from (``"aws"``, ``"gcp"``, ``"azure"``, ``"signal:SIGTERM"``,
    ...); ``deadline`` is the expected kill time in epoch seconds (``time.time()`` clock) or None when the
    source does not say; ``detail`` is the raw answer or a short human description.
    """

    source: str
    deadline: float | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        if not self.source:
            raise BambooConfigError(
                "Notice.source must name where the notice came from (got an empty string)"
            )

    def seconds_left(self, now: float | None = None) -> float | None:
        """Seconds from ``now`` (default: the current time) to the deadline, or None without a deadline."""
        if self.deadline is None:
            return None
        return self.deadline - (time.time() if now is None else now)


class NoticeSourceError(BambooError, OSError):
    """A notice source could not be read (unreachable, an HTTP error, or an answer in an unexpected format)."""


@runtime_checkable
class NoticePoller(Protocol):
    """Anything with a ``name`` and a ``poll()`` that returns a :class:`Notice`, None (no notice), or raises
    :class:`NoticeSourceError`. ``poll()`` must return within a bounded time."""

    name: str

    def poll(self) -> Notice | None: ...


def _check_endpoint(cls: str, endpoint: str, timeout: float) -> None:
    if not endpoint.startswith(("http://", "https://")):
        raise BambooConfigError(
            f"{cls}(endpoint={endpoint!r}): the endpoint must be an http(s) URL such as 'http://169.254.169.254'"
        )
    if not 0 < timeout <= 60:
        raise BambooConfigError(
            f"{cls}(timeout={timeout}): the HTTP timeout must be in (0, 60] seconds so a poll stays bounded; "
            "metadata servers answer in milliseconds, use e.g. 1.0"
        )


@dataclass(frozen=True)
class _Answer:
    status: int
    body: str


def _request(
    url: str, *, method: str = "GET", headers: Mapping[str, str] | None = None, timeout: float
) -> _Answer:
    """One HTTP request with a bounded timeout. HTTP error statuses are answers; network failures raise."""
    req = urllib.request.Request(url, method=method, headers=dict(headers or {}))
    # Metadata endpoints are link-local; a proxy from the environment must never see them.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return _Answer(resp.status, resp.read().decode("utf-8", errors="replace"))
    except urllib.error.HTTPError as err:
        body = err.read().decode("utf-8", errors="replace") if err.fp is not None else ""
        return _Answer(err.code, body)
    except (urllib.error.URLError, OSError) as err:  # refused, unreachable, timed out, reset
        raise NoticeSourceError(
            f"{url}: unreachable ({err}); is this machine on the cloud it names?"
        ) from err


def _utc_timestamp(when: datetime) -> float:
    """Epoch seconds of ``when``; a time without a zone is UTC (metadata services speak UTC)."""
    return (when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)).timestamp()


def _unexpected(url: str, answer: _Answer, expected: str) -> NoticeSourceError:
    return NoticeSourceError(
        f"{url}: unexpected answer (HTTP {answer.status}, body {answer.body[:200]!r}); expected {expected}"
    )


class AwsSpotPoller:
    """AWS EC2 spot interruption notice from the instance metadata service.

    ``GET /latest/meta-data/spot/instance-action`` answers 404 until an interruption is scheduled, then
    ``{"action": "terminate"|"stop"|"hibernate", "time": "2017-09-18T08:22:00Z"}`` about two minutes ahead.
    An IMDSv2 session token is requested first (``PUT /latest/api/token``) and reused until it expires;
    if the token request fails the poller falls back to IMDSv1 (no token).
    """

    name = "aws"
    _TOKEN_PATH = "/latest/api/token"
    _ACTION_PATH = "/latest/meta-data/spot/instance-action"

    def __init__(
        self, endpoint: str = "http://169.254.169.254", timeout: float = 1.0, token_ttl: int = 21600
    ):
        _check_endpoint(type(self).__name__, endpoint, timeout)
        if not 1 <= token_ttl <= 21600:
            raise BambooConfigError(
                f"AwsSpotPoller(token_ttl={token_ttl}): IMDSv2 accepts token lifetimes of 1..21600 seconds"
            )
        self.endpoint = endpoint.rstrip("/")
        self.timeout = timeout
        self.token_ttl = token_ttl
        self._token: str | None = None
        self._token_expiry = 0.0

    def _fresh_token(self) -> str | None:
        now = time.monotonic()
        if self._token is not None and now < self._token_expiry:
            return self._token
        self._token = None
        try:
            answer = _request(
                self.endpoint + self._TOKEN_PATH,
                method="PUT",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl)},
                timeout=self.timeout,
            )
        except NoticeSourceError:
            return None  # fall back to IMDSv1; the GET below reports unreachability
        if answer.status == 200 and answer.body.strip():
            self._token = answer.body.strip()
            self._token_expiry = now + self.token_ttl * 0.9
        return self._token

    def poll(self) -> Notice | None:
        url = self.endpoint + self._ACTION_PATH
        token = self._fresh_token()
        headers = {"X-aws-ec2-metadata-token": token} if token else {}
        answer = _request(url, headers=headers, timeout=self.timeout)
        if answer.status == 401 and token:  # token revoked or expired early: one retry with a new one
            self._token = None
            token = self._fresh_token()
            answer = _request(
                url, headers={"X-aws-ec2-metadata-token": token} if token else {}, timeout=self.timeout
            )
        if answer.status == 404:
            return None
        expected = 'HTTP 404 (no notice) or 200 with JSON {"action": ..., "time": "YYYY-MM-DDTHH:MM:SSZ"}'
        if answer.status != 200:
            raise _unexpected(url, answer, expected)
        try:
            doc = json.loads(answer.body)
            action = str(doc["action"])
            deadline = _utc_timestamp(datetime.fromisoformat(str(doc["time"]).replace("Z", "+00:00")))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise _unexpected(url, answer, expected) from err
        return Notice(source=self.name, deadline=deadline, detail=f"{action} at {doc['time']}")


class GcpPreemptionPoller:
    """GCP preemption notice from the Compute Engine metadata server.

    ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google`` answers ``FALSE``, then
    ``TRUE`` once the VM is being preempted. The answer carries no time; GCP documents about 30 seconds
    between the notice and the stop, so the notice's deadline is None and the callback applies its grace
    period.
    """

    name = "gcp"
    _PATH = "/computeMetadata/v1/instance/preempted"

    def __init__(self, endpoint: str = "http://metadata.google.internal", timeout: float = 1.0):
        _check_endpoint(type(self).__name__, endpoint, timeout)
        self.endpoint = endpoint.rstrip("/")
        self.timeout = timeout

    def poll(self) -> Notice | None:
        url = self.endpoint + self._PATH
        answer = _request(url, headers={"Metadata-Flavor": "Google"}, timeout=self.timeout)
        value = answer.body.strip().upper()
        if answer.status == 200 and value == "FALSE":
            return None
        if answer.status == 200 and value == "TRUE":
            return Notice(source=self.name, deadline=None, detail="instance/preempted=TRUE")
        raise _unexpected(url, answer, "HTTP 200 with body TRUE or FALSE")


class AzureScheduledEventsPoller:
    """Azure Spot eviction notice from Scheduled Events.

    ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true`` answers
    ``{"DocumentIncarnation": n, "Events": [...]}``; an event with ``"EventType": "Preempt"`` whose
    ``Resources`` name this VM is a notice, due at ``NotBefore`` (RFC 1123, e.g.
    ``"Mon, 19 Sep 2016 18:29:47 GMT"``; empty once the event has started). Scheduled events are delivered
    to every VM of an availability set or scale-set placement group, so events are matched against
    ``vm_name``; when ``vm_name`` is None it is read once from the instance metadata
    (``/metadata/instance/compute/name``), and if that fails every Preempt event counts.
    """

    name = "azure"
    _EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
    _NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"

    def __init__(
        self, endpoint: str = "http://169.254.169.254", timeout: float = 1.0, vm_name: str | None = None
    ):
        _check_endpoint(type(self).__name__, endpoint, timeout)
        self.endpoint = endpoint.rstrip("/")
        self.timeout = timeout
        self.vm_name = vm_name
        self._name_looked_up = vm_name is not None

    def _own_name(self) -> str | None:
        if not self._name_looked_up:
            self._name_looked_up = True
            try:
                answer = _request(
                    self.endpoint + self._NAME_PATH, headers={"Metadata": "true"}, timeout=self.timeout
                )
                if answer.status == 200 and answer.body.strip():
                    self.vm_name = answer.body.strip()
            except NoticeSourceError:
                pass
            if self.vm_name is None:
                log.warning(
                    "Azure scheduled events: this VM's name could not be read from %s; every Preempt event "
                    "will count as this VM's. Pass AzureScheduledEventsPoller(vm_name=...) to match exactly.",
                    self.endpoint + self._NAME_PATH,
                )
        return self.vm_name

    def poll(self) -> Notice | None:
        url = self.endpoint + self._EVENTS_PATH
        answer = _request(url, headers={"Metadata": "true"}, timeout=self.timeout)
        expected = 'HTTP 200 with JSON {"Events": [{"EventType": ..., "NotBefore": ..., "Resources": [...]}]}'
        if answer.status != 200:
            raise _unexpected(url, answer, expected)
        try:
            events = json.loads(answer.body)["Events"]
            if not isinstance(events, list):
                raise TypeError("Events is not a list")
            preempts = [e for e in events if e["EventType"] == "Preempt"]
        except (ValueError, KeyError, TypeError) as err:
            raise _unexpected(url, answer, expected) from err
        if not preempts:
            return None
        me = self._own_name()
        mine = [e for e in preempts if me is None or me in (e.get("Resources") or [])]
        if not mine:
            return None
        deadlines: list[float] = []
        for event in mine:
            not_before = str(event.get("NotBefore") or "").strip()
            if not not_before:  # already started: due now
                deadlines.append(time.time())
                continue
            try:
                deadlines.append(_utc_timestamp(email.utils.parsedate_to_datetime(not_before)))
            except (ValueError, TypeError) as err:
                raise _unexpected(
                    url, answer, "NotBefore in RFC 1123 form, e.g. 'Mon, 19 Sep 2016 18:29:47 GMT'"
                ) from err
        first = mine[deadlines.index(min(deadlines))]
        return Notice(
            source=self.name,
            deadline=min(deadlines),
            detail=f"Preempt {first.get('EventId', '?')} NotBefore {first.get('NotBefore', '')!r}",
        )


@dataclass
class _LogLimiter:
    """Logs a source's first failure at once, then at most one line per ``every`` seconds with a count."""

    every: float
    _last: dict[str, float] = field(default_factory=dict)
    _suppressed: dict[str, int] = field(default_factory=dict)

    def failure(self, source: str, err: Exception) -> None:
        now = time.monotonic()
        last = self._last.get(source)
        if last is not None and now - last < self.every:
            self._suppressed[source] = self._suppressed.get(source, 0) + 1
            return
        more = self._suppressed.pop(source, 0)
        suffix = f" ({more} similar failures since the last report)" if more else ""
        log.warning("preemption notice source %r failed, polling continues: %s%s", source, err, suffix)
        self._last[source] = now


class NoticeWatcher:
    """Polls notice sources on a daemon thread every ``interval`` seconds and hands the first notice to
    ``on_notice`` (called on the watcher thread; it must be cheap and thread-safe). Errors of a source are
    logged (rate-limited) and never end the thread. ``stop()`` wakes the thread and joins it with a timeout.
    """

    def __init__(
        self,
        pollers: Sequence[NoticePoller],
        on_notice: Callable[[Notice], None],
        interval: float = 3.0,
        log_every: float = 60.0,
    ):
        if not interval > 0:
            raise BambooConfigError(
                f"NoticeWatcher(interval={interval}): the poll interval must be > 0 seconds (Bamboo polls AWS every 3)"
            )
        self.pollers = list(pollers)
        self.on_notice = on_notice
        self.interval = interval
        self.polls = 0  # completed rounds over all sources (for tests and diagnostics)
        self._limiter = _LogLimiter(log_every)
        self._stop = threading.Event()
        self._round = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running or not self.pollers:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="bamboo-preemption-notices", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning(
                    "preemption notice thread did not stop within %.1f s; it is a daemon and is left", timeout
                )

    def wait_polls(self, count: int, timeout: float) -> bool:
        """Block until ``count`` rounds have completed (True) or ``timeout`` passes (False)."""
        with self._round:
            return self._round.wait_for(lambda: self.polls >= count, timeout)

    def poll_once(self) -> Notice | None:
        """One round over the sources; the first notice wins. Errors are logged, never raised."""
        found = None
        for poller in self.pollers:
            try:
                found = poller.poll()
            except Exception as err:  # a broken source must never take training down
                self._limiter.failure(getattr(poller, "name", type(poller).__name__), err)
                continue
            if found is not None:
                break
        with self._round:
            self.polls += 1
            self._round.notify_all()
        return found

    def _run(self) -> None:
        while not self._stop.is_set():
            notice = self.poll_once()
            if notice is not None:
                log.warning("preemption notice from %s: %s", notice.source, notice.detail)
                self.on_notice(notice)
                return  # the machine is going away; one notice is all we need
            self._stop.wait(self.interval)


#: the notice sources by name, each at its cloud's metadata endpoint
SOURCES: dict[str, Callable[..., NoticePoller]] = {
    "aws": AwsSpotPoller,
    "gcp": GcpPreemptionPoller,
    "azure": AzureScheduledEventsPoller,
}


def pollers_from_config(spec: object, where: str) -> list[NoticePoller]:
    """Pollers from a config's entry ``where``: a list of source names (``["aws"]``: each at its cloud's metadata
    endpoint) or a mapping of name to endpoint (``{"aws": "http://127.0.0.1:8080"}``: a local proxy, a test)."""
    if isinstance(spec, str):
        spec = [spec]
    if isinstance(spec, Mapping):
        chosen = dict(spec)
    elif isinstance(spec, Sequence):
        chosen = dict.fromkeys(spec)
    else:
        raise BambooConfigError(f"{where} must be a list of notice sources or a mapping of source to endpoint "
                                f"(got {type(spec).__name__}); e.g. [\"aws\"]")
    unknown = sorted(str(name) for name in chosen if name not in SOURCES)
    if unknown:
        raise BambooConfigError(f"{where} names {unknown}; the known notice sources are {sorted(SOURCES)}")
    return [SOURCES[name]() if endpoint is None else SOURCES[name](endpoint=str(endpoint))
            for name, endpoint in chosen.items()]
