"""``canner-upload``: upload files to a canner receiver, one receipt JSON line per file on stdout,
in the order of the files given (a failed file has no line).

Progress goes to stderr: a live display on a terminal, plain periodic lines otherwise, JSON lines
with ``--json-progress``.  Exit status: 0 every file receipted, 1 some failed (each on stderr with
the server's message), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TextIO

from canner_client import __version__
from canner_client.client import Client, ProgressEvent, Timeouts
from canner_client.errors import CannerError
from canner_client.receipt import Receipt
from canner_client.retry import RetryPolicy

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"8M"`` -> 8388608; K, M, G, T are powers of 1024 (an optional ``iB``/``B`` is ignored)."""
    value = text.strip().lower()
    for suffix in ("ib", "b"):
        if value.endswith(suffix) and value[: -len(suffix)][-1:].isalpha():
            value = value[: -len(suffix)]
            break
    unit = value[-1:] if value[-1:].isalpha() else ""
    number = value[: len(value) - len(unit)]
    if unit not in _UNITS or not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64M)")
    return int(number) * _UNITS[unit]


# The duration syntax of canner's config (Go's time.ParseDuration, unsigned), kept here so the
# client depends on nothing of canner's: tests/unit/test_config.py checks that both agree.
_DURATION_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "\u00b5s": 1e-6,
    "\u03bcs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")


def parse_duration(text: str) -> float:
    """``"1h30m"`` -> 5400.0: a Go duration (``"500ms"``, ``"20s"``, ``"0"``) in seconds, as in
    canner's config; ``ValueError`` for anything else, signed durations included."""
    if text == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(text):
        match = _DURATION_PART.match(text, pos)
        if match is None:
            break
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos == 0 or pos != len(text):
        raise ValueError(f'{text!r} is not a duration (such as "30s" or "1h30m")')
    return total


def _seconds(text: str) -> float:
    """A time option: plain seconds (``"90"``, ``"2.5"``) or a duration (``"20s"``, ``"1h30m"``)."""
    try:
        value = float(text)
    except ValueError:
        try:
            return parse_duration(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f'not a duration: {text!r} (seconds, or e.g. "20s", "1h30m")'
            ) from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (must not be negative)")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="canner-upload",
        description="Upload files to a canner receiver and print one receipt JSON line per file.",
        epilog='Times (S) are seconds ("90") or durations as in canner\'s config ("20s", "1h30m").',
    )
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument(
        "--url",
        default=os.environ.get("CANNER_URL"),
        help="the receiver, e.g. https://canner.example.org (default: $CANNER_URL)",
    )
    p.add_argument("--project", required=True, help="the project the files belong to")
    p.add_argument("--filename", help="the file name to declare (only with a single FILE)")
    p.add_argument("-j", "--parallel", type=int, default=2, help="files uploaded at once (2)")
    p.add_argument(
        "--chunk-size",
        type=parse_size,
        help="at most this many bytes per PATCH, so a failure resends at most that (e.g. 256M)",
    )
    p.add_argument("--state-dir", help="resume state directory (~/.cache/canner-upload)")
    p.add_argument("--restart", action="store_true", help="discard resume state of these files")
    p.add_argument("--connect-timeout", type=_seconds, default=30.0, metavar="S")
    p.add_argument("--read-timeout", type=_seconds, default=60.0, metavar="S")
    p.add_argument(
        "--acceptance-timeout",
        type=_seconds,
        default=3600.0,
        metavar="S",
        help="wait at most this long for the server to accept a complete file (3600)",
    )
    p.add_argument(
        "--deadline",
        type=_seconds,
        metavar="S",
        help="give up on a file after retrying this long in all; 0: never (21600). Without it,"
        " a server that refuses the first connections 3 times in a row is given up on at once"
        " (nothing listens there); with it, it is retried like any failure",
    )
    p.add_argument("--json-progress", action="store_true", help="progress as JSON lines on stderr")
    p.add_argument(
        "--log-interval", type=_seconds, default=10.0, metavar="S", help="plain progress period"
    )
    p.add_argument("--version", action="version", version=f"canner-upload {__version__}")
    return p


# Refused connections in a row, before the server ever answered, that mean "wrong address":
# about 3.5 s of backoff, while a restarting server that answered before is always waited for.
REFUSED_LIMIT = 3


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("--url is required (or set CANNER_URL)")
    if args.filename is not None and len(args.files) != 1:
        parser.error("--filename needs exactly one FILE")
    if args.parallel < 1:
        parser.error("--parallel must be at least 1")
    files: list[str] = []
    for name in args.files:
        full = os.path.abspath(name)
        if not os.path.isfile(full):
            parser.error(f"{name}: not a regular file")
        if full not in files:
            files.append(full)
    try:
        client = Client(
            args.url,
            timeout=Timeouts(args.connect_timeout, args.read_timeout, args.acceptance_timeout),
            retry=(
                RetryPolicy(refused_limit=REFUSED_LIMIT)
                if args.deadline is None
                else RetryPolicy(deadline=args.deadline or None)
            ),
            state_dir=args.state_dir,
            chunk_size=args.chunk_size,
        )
    except ValueError as e:
        parser.error(str(e))
    reporter = _reporter(args, files)
    return _run(client, args, files, reporter)


def _run(client: Client, args: argparse.Namespace, files: list[str], reporter: Reporter) -> int:
    printer = InOrder(len(files))

    def one(index: int, path: str) -> bool:
        try:
            receipt = client.upload(
                path, args.project, args.filename, progress=reporter.event, restart=args.restart
            )
        except (CannerError, OSError, ValueError) as e:
            reporter.failed(path, str(e))
            printer.settle(index, None)
            return False
        printer.settle(index, receipt)
        return True

    reporter.start()
    pool = ThreadPoolExecutor(max_workers=min(args.parallel, len(files)))
    try:
        failures = sum(not ok for ok in pool.map(one, range(len(files)), files))
    except KeyboardInterrupt:
        # Resume state is durable before any byte is sent: stop at once, not after the uploads.
        # A receipt in hand has no resume state left: it is printed now or never.
        reporter.stop()
        printer.flush()
        sys.stderr.write("canner-upload: interrupted; run the same command again to resume\n")
        sys.stderr.flush()
        os._exit(130)
    pool.shutdown()
    reporter.stop()
    return 1 if failures else 0


_PENDING = object()


class InOrder:
    """Receipt lines on stdout in the order of the files given (HQ takes each line as it is, so
    nothing else goes on a line).  A file's line is written once it and every file before it are
    settled: receipted, or failed (no line; the failure is on stderr)."""

    def __init__(self, count: int) -> None:
        self._results: list[object] = [_PENDING] * count
        self._next = 0
        self._lock = threading.Lock()

    def settle(self, index: int, receipt: Receipt | None) -> None:
        """File ``index`` is done: ``receipt``, or None when it failed."""
        with self._lock:
            self._results[index] = receipt
            while self._next < len(self._results) and self._results[self._next] is not _PENDING:
                self._write(self._results[self._next])
                self._next += 1

    def flush(self) -> None:
        """Write every receipt in hand, in order, skipping the files not done (interrupted)."""
        with self._lock:
            for result in self._results[self._next :]:
                self._write(result)
            self._next = len(self._results)

    @staticmethod
    def _write(result: object) -> None:
        if isinstance(result, Receipt):
            # sys.stdout is looked up now: a live display may have redirected it.
            sys.stdout.write(result.to_json() + "\n")
            sys.stdout.flush()


# -- progress -------------------------------------------------------------------------------------


class Reporter:
    """Receives progress events from upload threads; shows them somewhere on stderr."""

    def __init__(self, files: list[str], stream: TextIO) -> None:
        self.files = files
        self.stream = stream
        self.lock = threading.Lock()

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def event(self, ev: ProgressEvent) -> None:
        pass

    def failed(self, path: str, message: str) -> None:
        with self.lock:
            self.stream.write(f"canner-upload: {path}: {message}\n")
            self.stream.flush()


def _reporter(args: argparse.Namespace, files: list[str]) -> Reporter:
    if args.json_progress:
        return JsonReporter(files, sys.stderr)
    if sys.stderr.isatty():
        return RichReporter(files, sys.stderr)
    return PlainReporter(files, sys.stderr, args.log_interval)


class _Rate:
    """Bytes per second over the last few seconds of one phase."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []

    def add(self, done: int, now: float) -> None:
        self.samples.append((now, done))
        while len(self.samples) > 2 and now - self.samples[0][0] > 10.0:
            self.samples.pop(0)

    def rate(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        return (d1 - d0) / (t1 - t0) if t1 > t0 else None


class _FileState:
    def __init__(self) -> None:
        self.phase = "queued"
        self.done = 0
        self.total = 0
        self.object_id: str | None = None
        self.rate = _Rate()


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def resuming_text(ev: ProgressEvent) -> str:
    """``resuming at 139.0 MiB of 200.0 MiB (byte 145752064)``: where a resumed upload goes on."""
    return f"resuming at {human(ev.done)} of {human(ev.total)} (byte {ev.done})"


class _Tracking(Reporter):
    """Keeps per-file state (phase, bytes, rate) for the text reporters."""

    def __init__(self, files: list[str], stream: TextIO) -> None:
        super().__init__(files, stream)
        self.states = {path: _FileState() for path in files}

    def track(self, ev: ProgressEvent) -> tuple[_FileState, bool]:
        state = self.states.setdefault(ev.path, _FileState())
        changed = ev.phase != state.phase
        if changed:
            state.rate = _Rate()
        state.phase, state.done, state.total = ev.phase, ev.done, ev.total
        state.object_id = ev.object_id or state.object_id
        state.rate.add(ev.done, time.monotonic())
        return state, changed

    def describe(self, path: str, state: _FileState) -> str:
        name = os.path.basename(path)
        if state.phase in ("hashing", "uploading") and state.total:
            text = (
                f"{name}: {state.phase} {human(state.done)} / {human(state.total)} "
                f"({100 * state.done // state.total}%)"
            )
            rate = state.rate.rate()
            if rate:
                eta = (state.total - state.done) / rate if rate > 0 else 0
                text += f", {human(rate)}/s, ETA {eta:.0f}s"
            return text
        return f"{name}: {state.phase}"


class PlainReporter(_Tracking):
    """Plain lines for logs: phase changes at once, byte progress every ``interval`` seconds."""

    def __init__(self, files: list[str], stream: TextIO, interval: float) -> None:
        super().__init__(files, stream)
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.interval > 0:
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            with self.lock:
                active = [
                    (p, s) for p, s in self.states.items() if s.phase in ("hashing", "uploading")
                ]
                done = sum(s.done for s in self.states.values() if s.phase == "uploading")
                done += sum(
                    s.total for s in self.states.values() if s.phase in ("accepting", "done")
                )
                total = sum(os.path.getsize(p) for p in self.files if os.path.exists(p))
                for path, state in active:
                    self.stream.write(f"canner-upload: {self.describe(path, state)}\n")
                if active and len(self.files) > 1 and total:
                    self.stream.write(
                        f"canner-upload: overall {human(done)} / {human(total)} "
                        f"({100 * done // total}%)\n"
                    )
                self.stream.flush()

    def event(self, ev: ProgressEvent) -> None:
        with self.lock:
            _, changed = self.track(ev)
            if changed or ev.phase == "waiting":
                name = os.path.basename(ev.path)
                if ev.phase == "waiting":
                    line = f"{name}: retrying: {ev.message}"
                elif ev.phase == "resuming":
                    line = f"{name}: {resuming_text(ev)}"
                elif ev.phase == "done":
                    line = f"{name}: receipted as {ev.object_id}"
                else:
                    line = f"{name}: {ev.phase}" + (
                        f" ({human(ev.total)})" if ev.phase == "hashing" else ""
                    )
                self.stream.write(f"canner-upload: {line}\n")
                self.stream.flush()


class JsonReporter(_Tracking):
    """One JSON object per line on stderr: every phase change, byte progress at most 2/s."""

    def __init__(self, files: list[str], stream: TextIO) -> None:
        super().__init__(files, stream)
        self._last: dict[str, float] = {}

    def event(self, ev: ProgressEvent) -> None:
        with self.lock:
            state, changed = self.track(ev)
            now = time.monotonic()
            if not changed and ev.phase != "waiting" and now - self._last.get(ev.path, 0) < 0.5:
                return
            self._last[ev.path] = now
            doc: dict[str, Any] = {
                "file": ev.path,
                "phase": ev.phase,
                "done": ev.done,
                "total": ev.total,
            }
            if ev.object_id:
                doc["object_id"] = ev.object_id
            if ev.message:
                doc["message"] = ev.message
            rate = state.rate.rate()
            if rate is not None:
                doc["bytes_per_second"] = round(rate)
            self.stream.write(json.dumps(doc) + "\n")
            self.stream.flush()

    def failed(self, path: str, message: str) -> None:
        with self.lock:
            self.stream.write(json.dumps({"file": path, "phase": "failed", "message": message}))
            self.stream.write("\n")
            self.stream.flush()


class RichReporter(Reporter):
    """A live display: one line per file (hashing, then bytes, rate, ETA) and one overall."""

    def __init__(self, files: list[str], stream: TextIO) -> None:
        super().__init__(files, stream)
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.progress = Progress(
            TextColumn("{task.description}", justify="left"),
            BarColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(file=stream),
            transient=False,
        )
        self.sizes = {p: os.path.getsize(p) for p in files}
        self.tasks = {
            p: self.progress.add_task(f"queued    {os.path.basename(p)}", total=self.sizes[p])
            for p in files
        }
        self.phases: dict[str, str] = {}
        self.uploaded: dict[str, int] = {}
        self.overall = (
            self.progress.add_task("overall", total=sum(self.sizes.values()))
            if len(files) > 1
            else None
        )

    def start(self) -> None:
        self.progress.start()

    def stop(self) -> None:
        self.progress.stop()

    def event(self, ev: ProgressEvent) -> None:
        with self.lock:
            task = self.tasks.get(ev.path)
            if task is None:
                return
            name = os.path.basename(ev.path)
            if self.phases.get(ev.path) != ev.phase:
                self.phases[ev.path] = ev.phase
                if ev.phase in ("hashing", "uploading"):
                    self.progress.reset(task, total=ev.total or None, completed=ev.done)
                self.progress.update(task, description=f"{ev.phase:<9} {name}")
                if ev.phase == "waiting" and ev.message:
                    self._say(f"{name}: retrying: {ev.message}")
                if ev.phase == "resuming":
                    self._say(f"{name}: {resuming_text(ev)}")
            if ev.phase in ("hashing", "uploading", "done"):
                self.progress.update(task, completed=ev.done)
            if ev.phase in ("uploading", "accepting", "done"):
                self.uploaded[ev.path] = ev.done
                if self.overall is not None:
                    self.progress.update(self.overall, completed=sum(self.uploaded.values()))

    def failed(self, path: str, message: str) -> None:
        with self.lock:
            task = self.tasks.get(path)
            if task is not None:
                self.progress.update(task, description=f"failed    {os.path.basename(path)}")
            self._say(f"canner-upload: {path}: {message}")

    def _say(self, text: str) -> None:
        # Server messages are not rich markup; a long line stays one line to copy.
        self.progress.console.print(text, markup=False, highlight=False, soft_wrap=True)
