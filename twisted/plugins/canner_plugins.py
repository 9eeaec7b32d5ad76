"""twistd plugins ``canner-receiver`` and ``canner-deliver``: names only, loaded lazily."""

from twisted.application.service import ServiceMaker

# twistd finds plugins by module globals, so these keep Twisted's camelCase convention.
cannerReceiver = ServiceMaker(  # noqa: N816
    "canner receiver", "canner.tap.receiver", "canner: tus uploads and receipts", "canner-receiver"
)
cannerDeliver = ServiceMaker(  # noqa: N816
    "canner deliver",
    "canner.tap.deliver",
    "canner: delivery to the Internet Archive, verification, local purge",
    "canner-deliver",
)
