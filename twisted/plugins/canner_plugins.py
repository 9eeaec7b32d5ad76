"""twistd plugins ``canner-receiver`` and ``canner-deliver``: names only, loaded lazily."""

from twisted.application.service import ServiceMaker

cannerReceiver = ServiceMaker(  # noqa: N816 - twistd finds plugins by module globals
    "canner receiver", "canner.tap.receiver", "canner: tus uploads, receipts", "canner-receiver"
)
