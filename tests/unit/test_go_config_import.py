"""``canner import-go-config``: a Go canner config.json as canner TOML, every change reported.

The Go canner's config format and its quirks are docs/reference/go-canner.md §1.2 and §1.3.  Each
conversion runs through the real command (:func:`canner.cli.main.main`); its output is loaded with
the real loader and checked with ``canner check-config``.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from canner.cli.base import Io
from canner.cli.main import main
from canner.config import Config, load_config
from canner.templates import expand

SECRET = "s3cr3t-never-printed"


def example_config(keys: Path) -> str:
    """The Go canner's config.example.json as go-canner.md §1.2 describes it (values the sheet
    does not give, such as the collection, are plausible stand-ins); ``data`` is relative, as
    the sheet's tus ``.info`` example shows (hazard H11)."""
    return f"""{{
  "listen_addr": ":8080",
  "issuer": "https://canner.saveweb.org",
  "data_dir": "data",
  "max_upload_bytes": 107374182400,
  "min_free_bytes": 107374182400,
  "partial_upload_retention": "30m",
  "delivery_concurrency": 2,
  "projects": {{
    "example": {{
      "packaging": {{
        "type": "mergewarc",
        "trigger_bytes": 10737418240,
        "target_package_bytes": 1073741824,
        "max_wait": "24h"
      }},
      "delivery": {{
        "sink": "internet_archive",
        "credentials_file": "{keys}",
        "identifier": "saveweb-example-{{{{DATE}}}}-{{{{PACKAGE_ID_SHORT}}}}",
        "local_artifact_retention": "30s",
        "metadata": {{
          "collection": ["saveweb-example"],
          "mediatype": ["web"],
          "title": ["saveweb example {{{{OBJECT_ID}}}}"]
        }}
      }}
    }}
  }}
}}
"""


class Converted:
    """One run of ``canner import-go-config`` in ``root`` (the Go canner's working directory)."""

    def __init__(self, root: Path, text: str) -> None:
        self.root = root
        self.source = root / "config.json"
        self.source.write_text(text, encoding="utf-8")
        out, err = io.StringIO(), io.StringIO()
        self.code = main(["import-go-config", str(self.source)], Io(out, err))
        self.toml = out.getvalue()
        self.lines = err.getvalue().splitlines()

    def config(self, text: str | None = None) -> Config:
        path = self.root / "canner.toml"
        path.write_text(self.toml if text is None else text, encoding="utf-8")
        return load_config(path)

    def check_config(self) -> tuple[int, dict[str, Any], str]:
        path = self.root / "canner.toml"
        path.write_text(self.toml, encoding="utf-8")
        out, err = io.StringIO(), io.StringIO()
        code = main(["--config", str(path), "check-config"], Io(out, err, lambda: 1.7e9))
        return code, json.loads(out.getvalue()) if code == 0 else {}, err.getvalue()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    keys = tmp_path / "ia.keys"
    keys.write_text(f"ACCESSKEY\n{SECRET}\n", encoding="utf-8")
    keys.chmod(0o600)  # as the operator guide says (a looser mode is warned about)
    return tmp_path


def go_config(root: Path, **changes: Any) -> str:
    """A small valid Go config (one identity project) with top-level keys changed or removed
    (``None``), as JSON text."""
    config: dict[str, Any] = {
        "listen_addr": "127.0.0.1:8080",
        "issuer": "https://canner.saveweb.org",
        "data_dir": str(root / "data"),
        "max_upload_bytes": 1000,
        "min_free_bytes": 1,
        "delivery_concurrency": 1,
        "projects": {"p": {"packaging": {"type": "identity"}, "delivery": delivery(root)}},
    }
    config.update(changes)
    return json.dumps({k: v for k, v in config.items() if v is not None})


def delivery(root: Path, **changes: Any) -> dict[str, Any]:
    table = {
        "sink": "internet_archive",
        "credentials_file": str(root / "ia.keys"),
        "identifier": "saveweb-p-{{PACKAGE_ID_SHORT}}",
        "remote_name": "{{PROJECT}}.warc.gz",
        "local_artifact_retention": "1h",
    }
    table.update(changes)
    return {k: v for k, v in table.items() if v is not None}


def project(root: Path, packaging: dict[str, Any] | None = None, **changes: Any) -> dict[str, Any]:
    return {"packaging": packaging or {"type": "identity"}, "delivery": delivery(root, **changes)}


# -- the example config ------------------------------------------------------------------------


def test_example_config_converts_to_a_config_check_config_accepts(root: Path) -> None:
    """The Go example config becomes a megawarc project whose TOML passes check-config, with
    one line for each change."""
    run = Converted(root, example_config(root / "ia.keys"))
    assert run.code == 0
    assert run.lines == [
        "canner: warning: $.listen_addr: ':8080' listens on every IPv4 and IPv6 address in Go:"
        " written as tcp:8080 (IPv4 only; tcp6:8080:interface=\\:\\: takes both)",
        f"canner: warning: $.data_dir: 'data' is relative: the Go canner read it from its working"
        f" directory, canner from the config file's directory; written as '{root}/data' (the"
        " data directory; check it is where the Go canner ran)",
        "canner: warning: $.projects.example.packaging.type: mergewarc packages"
        " (<project>-<package id[:24]>.warc.zst) become canner megawarc items"
        " (<remote_name>.megawarc.warc.gz or .warc.zst, .megawarc.json.gz, ...)",
        "canner: warning: $.projects.example.packaging.trigger_bytes: no equivalent: canner does"
        " not wait for this many bytes before packing; a batch closes at target_bytes or"
        " max_wait",
        "canner: warning: $.projects.example.delivery.remote_name (default): {{PACKAGE_FILENAME}}"
        " (<project>-<package id[:24]><ext>) has no equivalent: {package} (canner names a"
        " megawarc item's files <remote_name>.megawarc.warc.gz and so on)",
        "canner: warning: $.projects.example.delivery.metadata.title[0]: {{OBJECT_ID}} is the"
        " package id in the Go canner (the artifact's tus id before 7410169): written as"
        " {package}",
    ]
    config = run.config()
    assert (config.issuer, config.listen, config.data_dir) == (
        "https://canner.saveweb.org",
        "tcp:8080",
        root / "data",
    )
    assert (config.max_upload_bytes, config.min_free_bytes) == (100 << 30, 100 << 30)
    assert (config.partial_upload_retention, config.delivery_concurrency) == (1800.0, 2)
    example = config.projects["example"]
    assert (example.packaging.mode, example.packaging.target_bytes) == ("megawarc", 1 << 30)
    assert example.packaging.max_wait == 86400.0
    assert example.delivery is not None
    assert example.delivery.identifier == "saveweb-example-{batch_date}-{package}"
    assert example.delivery.remote_name == "{package}"
    assert example.delivery.local_artifact_retention == 30.0
    assert example.delivery.credentials == root / "ia.keys"
    assert dict(example.delivery.metadata) == {
        "collection": ("saveweb-example",),
        "mediatype": ("web",),
        "title": ("saveweb example {package}",),
    }
    code, doc, err = run.check_config()
    assert (code, err) == (0, "")
    assert doc["delivery_examples"]["example"]["identifier"].startswith("saveweb-example-")


def test_the_keys_stay_in_their_file(root: Path) -> None:
    """The TOML names the Go canner's key file; no key, nor an unknown key's value, is printed."""
    text = go_config(root, projects={"p": project(root, access_key="AK", secret_key=SECRET)})
    run = Converted(root, text)
    assert run.code == 0
    assert f'credentials = "{root}/ia.keys"' in run.toml
    assert SECRET not in run.toml + "\n".join(run.lines)
    assert "ACCESSKEY" not in run.toml
    assert run.lines == [
        "canner: warning: $.projects.p.delivery.access_key: unknown key: the Go canner ignored"
        " it; not carried over",
        "canner: warning: $.projects.p.delivery.secret_key: unknown key: the Go canner ignored"
        " it; not carried over",
    ]


# -- ten quirks, one config each ---------------------------------------------------------------


def test_unknown_keys_are_reported_at_every_level(root: Path) -> None:
    """Keys the Go canner ignored are named with their JSON path, not carried over."""
    text = go_config(
        root,
        public_url="https://x.test/",
        projects={
            "p": {
                "packaging": {"type": "identity", "compression": "zstd"},
                "delivery": delivery(root, s3_url="https://s3.test"),
                "enabled": True,
            },
            "a.b": project(root),
        },
    )
    run = Converted(root, text)
    assert run.code == 0
    assert run.lines == [
        "canner: warning: $.projects.p.packaging.compression: unknown key: the Go canner"
        " ignored it; not carried over",
        "canner: warning: $.projects.p.delivery.s3_url: unknown key: the Go canner ignored it;"
        " not carried over",
        "canner: warning: $.projects.p.enabled: unknown key: the Go canner ignored it; not"
        " carried over",
        "canner: warning: $.public_url: unknown key: the Go canner ignored it; not carried over",
    ]
    config = run.config()
    assert set(config.projects) == {"p", "a.b"}
    assert config.projects["p"].delivery is not None
    assert config.projects["p"].delivery.s3_url == "https://s3.us.archive.org"
    assert run.check_config()[0] == 0


def test_keys_match_case_insensitively_and_the_last_duplicate_wins(root: Path) -> None:
    """ "ISSUER" after "issuer" wins, "Data_Dir" is data_dir, a Kelvin sign matches "k" as Go's
    folding does, and a dotless i matches nothing."""
    base = json.loads(go_config(root))
    base_project = base["projects"]["p"]
    text = (
        "{"
        f'"listen_addr": "127.0.0.1:8080", "issuer": "https://first.test",'
        f' "ISSUER": "https://last.test", "Data_Dir": {json.dumps(str(root / "data"))},'
        ' "max_upload_bytes": 1000, "min_free_bytes": 1, "delivery_concurrency": 1,'
        ' "\u0131ssuer": "https://dotless.test",'
        ' "projects": {"p": {"pac\u212aaging": {"type": "identity"},'
        f' "delivery": {json.dumps(base_project["delivery"])}}}}}'
        "}"
    )
    run = Converted(root, text)
    assert run.code == 0
    assert run.lines == [
        "canner: warning: $.ISSUER: read as 'issuer' (Go matches keys case-insensitively;"
        " canner's are exact); 'issuer' again after $.issuer: the last one wins",
        "canner: warning: $.Data_Dir: read as 'data_dir' (Go matches keys case-insensitively;"
        " canner's are exact)",
        'canner: warning: $["\u0131ssuer"]: unknown key: the Go canner ignored it; not carried'
        " over",
        "canner: warning: $.projects.p[\"pac\u212aaging\"]: read as 'packaging' (Go matches keys"
        " case-insensitively; canner's are exact)",
    ]
    assert run.config().issuer == "https://last.test"


def test_repeated_objects_merge_and_repeated_projects_replace(root: Path) -> None:
    """A second "projects" object adds to the first, a repeated project replaces the earlier
    one, and a second "delivery" object is merged into the first, as Go decodes them."""
    first = json.dumps({"q": project(root)})
    again = json.dumps(project(root, identifier="q-last-{{PACKAGE_ID}}"))
    more = json.dumps({"metadata": {"collection": ["merged"]}})
    text = go_config(root).replace(
        '"projects": {', f'"projects": {first}, "Projects": {{"q": {again}, '
    )
    last = text.rindex('"delivery": {')  # project p's
    text = text[:last] + f'"delivery": {more}, ' + text[last:]
    run = Converted(root, text)
    assert run.code == 0
    assert run.lines == [
        "canner: warning: $.Projects: read as 'projects' (Go matches keys case-insensitively;"
        " canner's are exact); 'projects' again after $.projects: Go merges this object into"
        " that one",
        "canner: warning: $.Projects.q: repeats the key of $.projects.q: the last one wins",
        "canner: warning: $.Projects.p.delivery: 'delivery' again after $.Projects.p.delivery:"
        " Go merges this object into that one",
    ]
    config = run.config()
    assert set(config.projects) == {"p", "q"}
    q, p = config.projects["q"].delivery, config.projects["p"].delivery
    assert q is not None and p is not None
    assert q.identifier == "q-last-{object_id}"
    assert (p.identifier, dict(p.metadata)) == (
        "saveweb-p-{object_id}",
        {"collection": ("merged",)},
    )


def test_object_id_that_meant_the_package_id_is_reported(root: Path) -> None:
    """{{OBJECT_ID}} named the package since 7410169: an identity project gets {object_id} and
    a report line."""
    text = go_config(root, projects={"p": project(root, identifier="p-{{OBJECT_ID}}")})
    run = Converted(root, text)
    assert run.code == 0
    assert run.lines == [
        "canner: warning: $.projects.p.delivery.identifier: {{OBJECT_ID}} is the package id in"
        " the Go canner (the artifact's tus id before 7410169): written as {object_id} (an"
        " identity item holds one object)",
    ]
    delivery_config = run.config().projects["p"].delivery
    assert delivery_config is not None and delivery_config.identifier == "p-{object_id}"


def test_unknown_tokens_and_braces_stay_literal(root: Path) -> None:
    """An unknown {{token}} (case matters) and single braces stay the literal text the Go
    canner sent."""
    metadata = {"description": ["{{project}} by {{PROJECT}} {x}"], "subject": ["{{NODE}}"]}
    text = go_config(root, projects={"p": project(root, metadata=metadata)})
    run = Converted(root, text)
    assert run.code == 0
    assert run.lines == [
        "canner: warning: $.projects.p.delivery.metadata.description[0]: {{project}} is no Go"
        " template variable: the Go canner sent it as literal text; kept literal",
        "canner: warning: $.projects.p.delivery.metadata.subject[0]: {{NODE}} is no Go template"
        " variable: the Go canner sent it as literal text; kept literal",
    ]
    delivery_config = run.config().projects["p"].delivery
    assert delivery_config is not None
    values = {"project": "p", "object_id": "0" * 32, "filename": "f", "date": "d"}
    expanded = {k: expand(v[0], values) for k, v in delivery_config.metadata.items()}
    assert expanded == {"description": "{{project}} by p {x}", "subject": "{{NODE}}"}


def test_package_filename_stays_unique_per_object(root: Path) -> None:
    """An identity item named by date alone: the default {{PACKAGE_FILENAME}} becomes
    {object_id}-{filename}, so every object still has its own name."""
    run = Converted(
        root,
        go_config(root, projects={"p": project(root, identifier="p-{{DATE}}", remote_name=None)}),
    )
    assert run.code == 0
    assert run.lines == [
        "canner: warning: $.projects.p.delivery.remote_name (default): {{PACKAGE_FILENAME}}"
        " (<project>-<package id[:24]><ext>) has no equivalent: {object_id}-{filename} (canner"
        " has no package file name; the object id keeps every name unique)",
    ]
    delivery_config = run.config().projects["p"].delivery
    assert delivery_config is not None
    assert (delivery_config.identifier, delivery_config.remote_name) == (
        "p-{date}",
        "{object_id}-{filename}",
    )
    assert run.check_config()[0] == 0


def test_no_delivery_concurrency_writes_the_delivery_tables_commented_out(root: Path) -> None:
    """Absent delivery_concurrency was 0, no delivery at all: the tables are written commented
    out, and they load once uncommented."""
    run = Converted(root, go_config(root, delivery_concurrency=None))
    assert run.code == 0
    assert run.lines == [
        "canner: warning: $.delivery_concurrency: absent, which is 0: the Go canner delivered"
        " nothing (its design.md says the default is 2, hazard H2); every delivery table is"
        " written commented out: uncomment them and set delivery_concurrency to deliver",
    ]
    assert "\ndelivery_concurrency" not in run.toml
    assert "\n# [projects.p.delivery]\n" in run.toml
    assert run.config().projects["p"].delivery is None
    code, _, err = run.check_config()
    assert code == 0
    assert err == "canner: warning: projects.p: no delivery table, artifacts stay local\n"
    head, table = run.toml.split("\n# [projects.p.delivery]\n")
    uncommented = (
        head + "\n[projects.p.delivery]\n" + table.replace("# ", "", 1).replace("\n# ", "\n")
    )
    delivery_config = run.config(uncommented).projects["p"].delivery
    assert delivery_config is not None and delivery_config.identifier == "saveweb-p-{object_id}"


def test_relative_paths_become_absolute_and_listen_addresses_endpoints(root: Path) -> None:
    """Go read relative paths from its working directory: they are written absolute; a
    localhost listen address becomes a loopback endpoint."""
    text = go_config(
        root,
        listen_addr="localhost:9000",
        data_dir="data",
        projects={"p": project(root, credentials_file="ia.keys")},
    )
    run = Converted(root, text)
    assert run.code == 0
    assert run.lines == [
        "canner: warning: $.listen_addr: 'localhost:9000': written as the address localhost"
        " names, 127.0.0.1",
        f"canner: warning: $.data_dir: 'data' is relative: the Go canner read it from its"
        f" working directory, canner from the config file's directory; written as"
        f" '{root}/data' (the data directory; check it is where the Go canner ran)",
        f"canner: warning: $.projects.p.delivery.credentials_file: 'ia.keys' is relative: the"
        f" Go canner read it from its working directory, canner from the config file's"
        f" directory; written as '{root}/ia.keys' (the IA key file; check it is where the Go"
        " canner ran)",
    ]
    config = run.config()
    assert config.listen == "tcp:9000:interface=127.0.0.1"
    assert run.check_config()[0] == 0


def test_metadata_keys_ia_refused_are_fixed_or_dropped(root: Path) -> None:
    """go2internetarchive refused these keys at every upload: "Title" is written lowercase,
    "TITLE" (the same key then) and "bad--key" are dropped, and so are blank values."""
    metadata = {
        "Title": ["t"],
        "TITLE": ["u"],
        "bad--key": ["x"],
        "subject": [],
        "collection": ["c", " "],
    }
    run = Converted(root, go_config(root, projects={"p": project(root, metadata=metadata)}))
    assert run.code == 0
    assert run.lines == [
        "canner: warning: $.projects.p.delivery.metadata.Title: a metadata key is lowercase"
        " [a-z][a-z0-9_.-]*: go2internetarchive refused it at every upload; written as 'title'",
        "canner: warning: $.projects.p.delivery.metadata.TITLE: a metadata key is lowercase"
        " [a-z][a-z0-9_.-]*: go2internetarchive refused it at every upload; dropped",
        'canner: warning: $.projects.p.delivery.metadata["bad--key"]: a metadata key'
        " containing '--' cannot be expressed as a header: go2internetarchive refused it at"
        " every upload; dropped",
        "canner: warning: $.projects.p.delivery.metadata.subject: no values: the Go canner sent"
        " nothing; dropped",
        "canner: warning: $.projects.p.delivery.metadata.collection[1]: empty: canner sends no"
        " empty value; dropped",
    ]
    delivery_config = run.config().projects["p"].delivery
    assert delivery_config is not None
    assert dict(delivery_config.metadata) == {"title": ("t",), "collection": ("c",)}


def test_signed_durations_and_identity_batch_settings(root: Path) -> None:
    """Go accepted "+30m"; canner takes no sign.  Batch settings Go ignored for identity
    packaging are reported, not carried over."""
    packaging = {"type": "identity", "max_wait": "1h", "target_package_bytes": 5}
    text = go_config(
        root,
        partial_upload_retention="+30m",
        projects={"p": project(root, packaging, local_artifact_retention="+1h30m")},
    )
    run = Converted(root, text)
    assert run.code == 0
    assert run.lines == [
        "canner: warning: $.partial_upload_retention: '+30m': canner takes no sign: written '30m'",
        "canner: warning: $.projects.p.packaging.target_package_bytes: ignored by the Go canner"
        " for identity packaging; not carried over",
        "canner: warning: $.projects.p.packaging.max_wait: ignored by the Go canner for"
        " identity packaging; not carried over",
        "canner: warning: $.projects.p.delivery.local_artifact_retention: '+1h30m': canner"
        " takes no sign: written '1h30m'",
    ]
    config = run.config()
    assert config.partial_upload_retention == 1800.0
    assert config.projects["p"].packaging.mode == "identity"
    assert run.check_config()[0] == 0


# -- what cannot be converted ------------------------------------------------------------------


def test_an_issuer_canner_refuses_is_an_error_and_nothing_is_written(root: Path) -> None:
    """Go had no length check on the issuer; canner refuses one over 512 bytes: exit 1, no
    TOML."""
    issuer = "https://canner.saveweb.org/" + "x" * 500
    run = Converted(root, go_config(root, issuer=issuer))
    assert (run.code, run.toml) == (1, "")
    assert run.lines == [
        "canner: error: $.issuer: canner refuses the converted value: must be at most 512 bytes",
        f"canner: {run.source}: not converted (errors above)",
    ]


def test_an_identifier_canner_refuses_is_an_error(root: Path) -> None:
    """An identifier with an unknown token broke every Go delivery (H1); canner refuses it at
    load, naming the JSON path."""
    text = go_config(root, projects={"p": project(root, identifier="p-{{ID}}-{{PACKAGE_ID}}")})
    run = Converted(root, text)
    assert run.code == 1
    assert run.lines[-2].startswith(
        "canner: error: $.projects.p.delivery.identifier: canner refuses the converted value:"
        " expands to 'p-{{ID}}-"
    )


def test_the_command_writes_its_output_atomically_and_check_config_reads_it(root: Path) -> None:
    """As a process: --output writes the TOML, stderr holds the report, check-config passes."""
    source = root / "config.json"
    source.write_text(example_config(root / "ia.keys"), encoding="utf-8")
    output = root / "canner.toml"
    command = [sys.executable, "-m", "canner.cli.main", "import-go-config", str(source)]
    done = subprocess.run([*command, "--output", str(output)], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "")
    assert len(done.stderr.splitlines()) == 6
    assert tomllib.loads(output.read_text())["projects"]["example"]["packaging"]["mode"] == (
        "megawarc"
    )
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []
    check = [sys.executable, "-m", "canner.cli.main", "--config", str(output), "check-config"]
    done = subprocess.run(check, capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize(
    ("listen_addr", "listen"),
    [
        ("0.0.0.0:80", "tcp:80"),
        ("[::1]:8080", "tcp6:8080:interface=\\:\\:1"),
        ("[::]:08080", "tcp6:8080:interface=\\:\\:"),
        ("127.0.0.1:http", None),
        ("8080", None),
    ],
)
def test_listen_addresses_become_endpoints(
    root: Path, listen_addr: str, listen: str | None
) -> None:
    """Go's host:port becomes a Twisted endpoint; a named port or no port is an error."""
    run = Converted(root, go_config(root, listen_addr=listen_addr))
    if listen is None:
        assert run.code == 1
        assert run.lines[0].startswith("canner: error: $.listen_addr: ")
    else:
        assert (run.code, run.lines) == (0, [])
        assert run.config().listen == listen
