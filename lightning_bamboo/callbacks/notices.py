"""The cloud notice sources, under the name Lightning users and CLI configs know (``class_path:
lightning_bamboo.callbacks.notices.AwsSpotPoller``). They live in ``runtime.notices``, without Lightning, so that the
DeepSpeed door polls them too (``"bamboo": {"notices": ["aws"]}``)."""

from __future__ import annotations

from lightning_bamboo.runtime.notices import (
    AwsSpotPoller,
    AzureScheduledEventsPoller,
    GcpPreemptionPoller,
    Notice,
    NoticePoller,
    NoticeSourceError,
    NoticeWatcher,
)

__all__ = [
    "AwsSpotPoller",
    "AzureScheduledEventsPoller",
    "GcpPreemptionPoller",
    "Notice",
    "NoticePoller",
    "NoticeSourceError",
    "NoticeWatcher",
]
