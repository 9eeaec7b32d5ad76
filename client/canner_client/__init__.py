"""canner_client: upload artifacts to a canner receiver and keep their receipts.

>>> from canner_client import Client
>>> receipt = Client("http://127.0.0.1:8080").upload("crawl.warc.gz", project="example")
>>> print(receipt.to_json())
"""

__version__ = "0.1.0"

from canner_client.client import Client, ObjectStatus, ProgressEvent, Timeouts
from canner_client.errors import (
    CannerError,
    DeadlineExceeded,
    EndpointMissing,
    FileChanged,
    NothingListens,
    ReceiptMismatch,
    UnknownObject,
    UploadLost,
    UploadRefused,
)
from canner_client.receipt import Receipt
from canner_client.retry import RetryPolicy
from canner_client.state import UploadSession

__all__ = [
    "CannerError",
    "Client",
    "DeadlineExceeded",
    "EndpointMissing",
    "FileChanged",
    "NothingListens",
    "ObjectStatus",
    "ProgressEvent",
    "Receipt",
    "ReceiptMismatch",
    "RetryPolicy",
    "Timeouts",
    "UnknownObject",
    "UploadLost",
    "UploadRefused",
    "UploadSession",
    "__version__",
]
