"""End to end: dictionary-less ``.warc.zst`` members, made with the real ``zstd`` CLI, packed by
real ``twistd`` processes with their dictionaries from a test dictionary API over real HTTP.

The API (megawarc's ``--server``: ``?project=&id=`` -> ``{"id", "url", "sha256"}``, then the
dictionary) first fails (503 for one dictionary, a wrong SHA-256 for the other): the batch waits,
``canner status`` says so, nothing is packed.  Once it answers, each dictionary is fetched once,
the package is delivered, restores byte for byte by megawarc's rules, and ``zstd -t -D`` passes
on every member at its offset.  A restarted deliver packs a later member of a kept dictionary
without asking the API again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from deliver_support import REPO, Env, envs, venv_bin, wait_for

from tests.packaging_support import restore_package, warc_bytes, warc_record

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd CLI (apt zstd)"),
]
env_factory_fixture = pytest.fixture(name="env_factory")(envs)

RAW_ID, COMPRESSED_ID = "1234567890", "2345678901"


def zstd(*args: str | Path, stdin: bytes | None = None) -> bytes:
    out = subprocess.run(["zstd", "-q", *map(str, args)], input=stdin, capture_output=True)
    assert out.returncode == 0, f"zstd {args}: {out.stderr.decode()}"
    return out.stdout


def train(directory: Path, dict_id: str, seed: int) -> Path:
    """A dictionary trained by ``zstd --train`` on WARC records, with ``dict_id`` as its id."""
    samples = directory / f"samples-{dict_id}"
    samples.mkdir(parents=True)
    for i in range(300):
        record = warc_record(f"http://example.com/{seed}/{i}", f"<html>{seed} {i} ".encode() * 20)
        (samples / f"{i}.warc").write_bytes(record)
    path = directory / f"{dict_id}.dict"
    zstd("--train", "-r", samples, "-o", path, "--maxdict=8192", f"--dictID={dict_id}")
    return path


def dictless_member(dictionary: Path, seed: int) -> bytes:
    """What Wget-AT writes with ``--warc-zstd-dict-no-include``: a frame per record made with
    ``zstd -D``, no dictionary frame."""
    return b"".join(
        zstd("-D", dictionary, "-c", stdin=warc_bytes(seed * 10 + i, records=1, gz=False))
        for i in range(3)
    )


class DictionaryApi:
    """A dictionary API on 127.0.0.1, in a thread: ``/api?project=&id=`` and ``/dict/<id>``.
    ``failing`` maps an id to how it fails (``503``: the API; ``sha``: a wrong SHA-256)."""

    def __init__(self, served: dict[str, bytes]) -> None:
        self.served = served
        self.failing: dict[str, str] = {}
        self.requests: Counter[str] = Counter()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                api.requests[parts.path] += 1
                if parts.path == "/api":
                    query = parse_qs(parts.query)
                    dict_id = query["id"][0]
                    if api.failing.get(dict_id) == "503" or query["project"] != ["urls"]:
                        return self.answer(503, b"try later")
                    data = api.served[dict_id]
                    digest = hashlib.sha256(data).hexdigest()
                    if api.failing.get(dict_id) == "sha":
                        digest = hashlib.sha256(data + b"x").hexdigest()
                    doc = {"id": dict_id, "url": f"{api.url}/dict/{dict_id}", "sha256": digest}
                    return self.answer(200, json.dumps(doc).encode())
                return self.answer(200, api.served[parts.path.rsplit("/", 1)[1]])

            def answer(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def dictionaries(tmp_path: Path) -> Iterator[tuple[DictionaryApi, dict[str, Path]]]:
    raw = train(tmp_path / "dicts", RAW_ID, 1)
    other = train(tmp_path / "dicts", COMPRESSED_ID, 2)
    # One served as zstd --train writes it, the other zstd-compressed (megawarc takes both).
    served = {RAW_ID: raw.read_bytes(), COMPRESSED_ID: zstd("-19", "-c", other)}
    api = DictionaryApi(served)
    try:
        yield api, {RAW_ID: raw, COMPRESSED_ID: other}
    finally:
        api.close()


def canner(env: Env, *args: str) -> str:
    out = subprocess.run(
        [venv_bin("canner"), *args, "--config", str(env.config)],
        cwd=REPO,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert out.returncode in (0, 1), f"canner {args} failed: {out.stderr.decode()}"
    return out.stdout.decode()


def package_at_ia(env: Env, scratch: Path) -> tuple[Path, str]:
    """The one package's files as the fake IA stores them, copied into ``scratch``."""
    scratch.mkdir()
    basenames = set()
    for o in env.fake.objects():
        shutil.copyfile(o["path"], scratch / o["name"])
        basenames.add(o["name"].split(".", 1)[0])
    (basename,) = basenames
    return scratch, basename


def test_dictionary_less_members_wait_for_the_api_then_pack_behind_their_dictionaries(
    env_factory: Any, tmp_path: Path, dictionaries: tuple[DictionaryApi, dict[str, Path]]
) -> None:
    """Members made with zstd -D wait while the dictionary API fails, then are packed into one
    megawarc per dictionary that restores byte for byte and that zstd -t -D checks member by
    member; each dictionary is fetched once, and kept across a restart."""
    api, dict_files = dictionaries
    api.failing = {RAW_ID: "503", COMPRESSED_ID: "sha"}
    env = env_factory(
        packaging={
            "mode": "megawarc",
            "target_bytes": "10MB",
            "max_wait": "2s",
            "zstd_dictionary_url": f"{api.url}/api",
        },
        retention="1h",
    )
    named = [
        *(
            (f"item{i}.urls.{dict_id}.warc.zst", dictless_member(dict_files[dict_id], i))
            for i, dict_id in enumerate([RAW_ID, COMPRESSED_ID, RAW_ID, COMPRESSED_ID])
        ),
        ("crawl.warc.gz", warc_bytes(7)),
        ("notes.txt", b"not a WARC\n" * 40),
    ]
    uploaded = {env.upload(data, filename=name): (name, data) for name, data in named}

    def waiting() -> dict[str, Any] | None:
        doc = json.loads(canner(env, "status", "--json"))
        waits = {w["dict_id"] for w in doc["dictionary_waits"]}
        return doc if waits == {RAW_ID, COMPRESSED_ID} else None

    wait_for(waiting, 60, "both dictionaries waited for", 0.5, env.describe)
    text = canner(env, "status")
    assert f"zstd dictionary {RAW_ID} of urls" in text and "answered 503" in text
    assert f"zstd dictionary {COMPRESSED_ID} of urls" in text and "SHA-256" in text
    rows = [json.loads(line) for line in canner(env, "packages").splitlines() if line.strip()]
    assert [(r["state"], r["package_id"]) for r in rows] == [("closed", None)]
    assert "waiting for zstd dictionary" in rows[0]["build_error"]
    assert env.fake.objects() == []
    assert api.requests[f"/dict/{RAW_ID}"] == 0  # the API itself failed

    api.failing = {}
    api.requests.clear()
    env.wait_state(list(uploaded), 120, "every member delivered", state="delivered")
    fetched_once = {"/api": 2, f"/dict/{RAW_ID}": 1, f"/dict/{COMPRESSED_ID}": 1}
    assert api.requests == fetched_once
    assert json.loads(canner(env, "status", "--json"))["dictionary_waits"] == []

    directory, basename = package_at_ia(env, tmp_path / "ia")
    names = {p.name[len(basename) :] for p in directory.iterdir()}
    assert names == {
        ".megawarc.warc.gz",
        ".megawarc.tar",
        ".megawarc.json.gz",
        *(f".{d}.megawarc.{s}" for d in (RAW_ID, COMPRESSED_ID) for s in ("warc.zst", "json.gz")),
    }
    restored = restore_package(directory, basename, tmp_path / "restore")
    assert restored == {f"{oid}/{name}": data for oid, (name, data) in uploaded.items()}
    checked = 0
    for dict_id, dictionary in dict_files.items():
        container = directory / f"{basename}.{dict_id}.megawarc.warc.zst"
        blob = container.read_bytes()
        assert blob[:4] == b"\x5d\x2a\x4d\x18" and blob[8:12] == b"\x28\xb5\x2f\xfd"
        zstd("-t", "-D", dictionary, container)  # the whole megawarc, frame and members
        index = directory / f"{basename}.{dict_id}.megawarc.json.gz"
        for line in subprocess.run(
            ["zcat", index], capture_output=True, check=True
        ).stdout.splitlines():
            target = json.loads(line)["target"]
            assert target["container"] == "warc"
            member = tmp_path / f"member-{checked}.zst"
            member.write_bytes(blob[target["offset"] : target["offset"] + target["size"]])
            zstd("-t", "-D", dictionary, member)
            checked += 1
    assert checked == 4
    kept = sorted(p.name for p in (env.data_dir / "dictionaries").iterdir())
    assert [k.split("-")[0] for k in kept] == [RAW_ID, COMPRESSED_ID]

    env.deliver.stop()
    env.deliver.start()
    later = env.upload(dictless_member(dict_files[RAW_ID], 9), f"late.urls.{RAW_ID}.warc.zst")
    env.wait_state([later], 120, "the later member delivered", state="delivered")
    assert api.requests == fetched_once
