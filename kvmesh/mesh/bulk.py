"""The bulk data path, both ends: re-exports of :mod:`.bulk_wire` (the protocol),
:mod:`.bulk_client` and :mod:`.bulk_server` while importers move to those."""

from .bulk_client import *  # noqa: F403
from .bulk_server import *  # noqa: F403
from .bulk_wire import *  # noqa: F403
from .bulk_wire import Stream as _Stream  # noqa: F401
from .transport import StreamTimes as StreamTimes
