"""The cloud notice sources, under the name Lightning users and CLI configs know (``class_path:
lightning_bamboo.callbacks.notices.AwsSpotPoller``). They live in ``runtime.notices``, without Lightning, so that the
DeepSpeed door polls them too (``"bamboo": {"notices": ["aws"]}``)."""

from __future__ import annotations

from lightning_bamboo.runtime import notices as _notices
from lightning_bamboo.runtime.notices import *  # noqa: F403 - the same names, re-exported

__all__ = list(_notices.__all__)
