"""Credentials files, folders, the environment and flags: what wins, and clear errors for bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedmq.broker import BusConfig
from fedmq.broker.errors import CredentialsError
from fedmq.broker.servers.credentials import Access, Credentials, from_environment, read_credentials_file


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_a_credentials_file_resolves_paths_next_to_it(tmp_path: Path) -> None:
    (tmp_path / "ca.crt").write_text("synthetic")
    (tmp_path / "creds").mkdir()
    path = _write(
        tmp_path / "creds" / "node-003.json", {"username": "node-003", "password": "pw-7781", "ca_file": "../ca.crt"}
    )
    creds = read_credentials_file(path)
    assert creds.username == "node-003" and creds.password == "pw-7781"
    assert creds.ca_file == str((tmp_path / "ca.crt").resolve())
    assert "pw-7781" not in repr(creds)  # the password never reaches a log line


def test_a_password_file_is_read_and_its_newline_dropped(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("hunter2\n")
    creds = read_credentials_file(_write(tmp_path / "c.json", {"username": "u", "password_file": "pw"}))
    assert creds.password == "hunter2"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"user": "x"}), "unknown field(s) user"),
        (json.dumps({"username": ""}), "username must be a non-empty string"),
        (json.dumps({"username": "u", "ca_file": "missing.crt"}), "ca_file 'missing.crt' does not exist"),
        (json.dumps({"password": "a", "password_file": "c.json"}), "not both"),
    ],
)
def test_bad_credentials_files_say_what_is_wrong(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(CredentialsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_credentials_file(path)


def test_a_folder_gives_each_identity_its_own_file_and_names_a_missing_one(tmp_path: Path) -> None:
    _write(tmp_path / "node-000.json", {"username": "node-000", "password": "a"})
    _write(tmp_path / "node-001.json", {"username": "node-001", "password": "b"})
    access = Access(source=tmp_path, use_environment=False)
    assert access.for_identity("node-001").password == "b"
    with pytest.raises(CredentialsError, match="no credentials for 'node-002'"):
        access.for_identity("node-002")
    with pytest.raises(CredentialsError, match="does not exist"):
        Access(source=tmp_path / "nowhere")


def test_flags_override_the_file_which_overrides_the_environment(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("FEDMQ_BROKER_USERNAME", "env-user")
    monkeypatch.setenv("FEDMQ_BROKER_PASSWORD", "env-pw")
    assert from_environment() == Credentials(username="env-user", password="env-pw")
    path = _write(tmp_path / "c.json", {"username": "file-user"})
    access = Access(source=path, flags=Credentials(password="flag-pw"))
    assert access.for_identity("any") == Credentials(username="file-user", password="flag-pw")
    assert Access(source=path, use_environment=False).for_identity("any").password is None


def test_password_file_from_the_environment(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "pw").write_text("from-file\n")
    monkeypatch.delenv("FEDMQ_BROKER_PASSWORD", raising=False)
    monkeypatch.setenv("FEDMQ_BROKER_PASSWORD_FILE", str(tmp_path / "pw"))
    assert from_environment().password == "from-file"
    (tmp_path / "pw").write_text("")
    with pytest.raises(CredentialsError, match="is empty"):
        from_environment()


def test_mqtts_urls_and_tls_settings() -> None:
    c = BusConfig.from_url("mqtts://broker.example")
    assert c.tls and c.port == 8883 and c.url == "mqtts://broker.example:8883"
    assert BusConfig.from_url("mqtt://u:secret@localhost").url == "mqtt://localhost:1883"  # never in the URL shown
    with pytest.raises(ValueError, match="use mqtts://"):
        BusConfig.from_url("mqtt://h", ca_file="ca.crt")
    with pytest.raises(ValueError, match="needs its key"):
        BusConfig.from_url("mqtts://h", cert_file="c.crt")
