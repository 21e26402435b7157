"""API keys and their limits as configured: ``NMT_API_KEYS``, the keys file ``NMT_API_KEYS_FILE``
and the ``NMT_KEY_*`` defaults (app/keys/accepted.py)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from app.config import describe_settings_error
from app.keys.accepted import KeysError, load_keys
from app.keys.usage import KeyLimits
from tests.test_api import make_settings, serve

REPO = Path(__file__).resolve().parents[1]


def digest_name(key: str) -> str:
    """What a key of NMT_API_KEYS is named (docs/keys.md), computed here anew."""
    return "sha256-" + hashlib.sha256(key.encode()).hexdigest()[:16]


ENV_SECRET = digest_name("env-secret")


def write_keys(directory: Path, text: str) -> Path:
    path = directory / "keys.toml"
    path.write_text(text)
    return path


def test_keys_have_names_and_their_own_limits_over_the_defaults(tmp_path: Path, model_dir: Path) -> None:
    digest = hashlib.sha256(b"hashed-secret").hexdigest()
    path = write_keys(
        tmp_path,
        f"""
        [[keys]]
        name = "acme"
        key = "plain-secret"
        requests_per_minute = 120
        chars_per_day = 0

        [[keys]]
        name = "hashed"
        sha256 = "{digest.upper()}"
        """,
    )
    settings = make_settings(
        model_dir,
        api_keys="env-one,env-two,env-one",
        api_keys_file=path,
        key_requests_per_minute=10,
        key_chars_per_day=5000,
    )
    keys = load_keys(settings)
    assert len(keys) == 4  # a key listed twice is one key
    found = {name: keys.find(name) for name in ("plain-secret", "hashed-secret", "env-one", "env-two")}
    assert {k: v.name if v else None for k, v in found.items()} == {
        "plain-secret": "acme",
        "hashed-secret": "hashed",
        "env-one": digest_name("env-one"),
        "env-two": digest_name("env-two"),
    }
    assert keys.find("acme") is None and keys.find(digest) is None  # a name or a digest is no key
    assert found["plain-secret"] and found["plain-secret"].limits == KeyLimits(requests_per_minute=120)
    assert found["hashed-secret"] and found["hashed-secret"].limits == KeyLimits(10, 0, 0, 5000, 0, 0)
    assert found["env-one"] and found["env-one"].limits == found["hashed-secret"].limits
    assert settings.keys_required


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[keys]]\nname = 'a'\n", "keys[0]: Value error, give either key or sha256"),
        ("[[keys]]\nname = 'a'\nkey = 'the-secret'\nsha256 = '" + "0" * 64 + "'\n", "not both"),
        ("[[keys]]\nname = 'a'\nkey = 'the-secret'\nrequests_per_minute = -1\n", "requests_per_minute"),
        ("[[keys]]\nname = 'a'\nkey = 'the-secret'\nrequest_per_minute = 1\n", "keys[0].request_per_minute"),
        ("[[keys]]\nname = 'a b'\nkey = 'the-secret'\n", "keys[0].name"),
        ("[[keys]]\nname = 'a'\nsha256 = 'the-secret'\n", "keys[0].sha256"),
        (
            "[[keys]]\nname = 'a'\nkey = 'the-secret'\n[[keys]]\nname = 'a'\nkey = 'x'\n",
            "'a' is also keys[0]",
        ),
        ("[[keys]]\nname = 'a'\nkey = 'the-secret'\n[[keys]]\nname = 'b'\nkey = 'the-secret'\n", "same key"),
        (f"[[keys]]\nname = '{ENV_SECRET}'\nkey = 'x'\n", "that of a key of NMT_API_KEYS"),
        ("[[keys]]\nname = 'a'\nkey = 'env-secret'\n", f"same key as '{ENV_SECRET}'"),
        ("keys = []\n", "keys: List should have at least 1 item"),
        ("[[keys]\nname = 'the-secret'\n", "not valid TOML"),
    ],
)
def test_a_bad_keys_file_is_one_line_naming_the_entry_never_a_key(
    tmp_path: Path, model_dir: Path, text: str, message: str
) -> None:
    settings = make_settings(model_dir, api_keys="env-secret", api_keys_file=write_keys(tmp_path, text))
    with pytest.raises(KeysError) as raised:
        load_keys(settings)
    error = str(raised.value)
    assert error.startswith(f"NMT_API_KEYS_FILE ({tmp_path / 'keys.toml'}): "), error
    assert message in error and "\n" not in error
    assert "secret" not in error


def test_a_missing_keys_file_is_named(tmp_path: Path, model_dir: Path) -> None:
    settings = make_settings(model_dir, api_keys_file=tmp_path / "nope.toml")
    with pytest.raises(KeysError, match=r"nope.toml\): cannot read it: No such file"):
        load_keys(settings)


def test_key_limits_without_keys_are_a_configuration_error(model_dir: Path) -> None:
    with pytest.raises(ValidationError) as raised:
        make_settings(model_dir, key_requests_per_minute=60, key_max_concurrent=2)
    message = describe_settings_error(raised.value)
    assert "NMT_KEY_REQUESTS_PER_MINUTE, NMT_KEY_MAX_CONCURRENT limit API keys, but none is configured" in (
        message
    )


def test_key_metrics_without_keys_is_no_limit_without_a_key(model_dir: Path) -> None:
    assert make_settings(model_dir, key_metrics=True).key_metrics  # shows nothing, refused nothing


def test_a_key_of_nmt_api_keys_is_named_by_its_digest_wherever_it_is_listed(model_dir: Path) -> None:
    both = load_keys(make_settings(model_dir, api_keys="k1,k2"))
    alone = load_keys(make_settings(model_dir, api_keys="k2"))
    named = (both.find("k2"), alone.find("k2"))
    assert named[0] and named[1] and named[0].name == named[1].name == digest_name("k2")
    found = both.find("k1")
    assert found and found.name == digest_name("k1")


def test_the_owner_command_prints_a_keys_name_never_the_key() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app.keys.accepted", "owner"],
        input="  the-secret-key \n",
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert done.stdout == digest_name("the-secret-key") + "\n"
    assert "secret" not in done.stdout + done.stderr
    usage = subprocess.run(
        [sys.executable, "-m", "app.keys.accepted"], capture_output=True, text=True, cwd=REPO
    )
    assert usage.returncode == 2 and "usage" in usage.stderr


# --- owners across a change of the key list ----------------------------------------------------------


def store_each(client: TestClient, key: str, segments: int) -> tuple[str, str]:
    """A glossary, ``segments`` memory segments and a job of ``key``: (glossary id, job id)."""
    auth = {"X-API-Key": key}
    entries = [{"source": "Haus", "target": key}]
    body = {"name": f"g-{key}", "source_lang": "de", "target_lang": "en", "entries": entries}
    glossary = client.post("/glossaries", json=body, headers=auth)
    assert glossary.status_code == 201, glossary.text
    table = "".join(f"Satz {key} {i}.\tSentence {i}.\n" for i in range(segments)).encode()
    fields = {"source_lang": "de", "target_lang": "en"}
    assert (
        client.post("/memories", data=fields, files={"file": ("m.tsv", table)}, headers=auth).status_code
        == 200
    )
    job = client.post(
        "/jobs", data={"source": "de", "target": "en"}, files={"file": ("a.txt", b"Ein Hund.")}, headers=auth
    )
    assert job.status_code == 202, job.text
    return glossary.json()["id"], job.json()["id"]


def holdings(client: TestClient, key: str) -> tuple[list[str], int, list[str]]:
    """What ``key`` sees: its glossaries' ids, its memory's segments, its jobs' ids."""
    auth = {"X-API-Key": key}
    glossaries = [g["id"] for g in client.get("/glossaries", headers=auth).json()["glossaries"]]
    segments = client.get("/memories", headers=auth).json()["segments"]
    jobs = [j["id"] for j in client.get("/jobs", headers=auth).json()["jobs"]]
    return glossaries, segments, jobs


def test_each_keys_data_stays_its_own_when_another_key_is_removed_and_added_back(
    model_dir: Path, tmp_path: Path
) -> None:
    def settings(keys: str) -> Any:
        return make_settings(model_dir, api_keys=keys, data_dir=tmp_path, warmup=False)

    with serve(settings("k1,k2")) as client:
        g1, j1 = store_each(client, "k1", segments=1)
        g2, j2 = store_each(client, "k2", segments=2)
        assert holdings(client, "k1") == ([g1], 1, [j1])
        assert holdings(client, "k2") == ([g2], 2, [j2])
    with serve(settings("k2")) as client:  # k1 removed: k2 is now the first key listed
        assert holdings(client, "k2") == ([g2], 2, [j2])  # its own, not k1's
        assert client.get("/glossaries", headers={"X-API-Key": "k1"}).status_code == 403
    with serve(settings("k2,k1")) as client:  # k1 back, in another place
        assert holdings(client, "k1") == ([g1], 1, [j1])
        assert holdings(client, "k2") == ([g2], 2, [j2])


def test_a_key_moved_into_the_keys_file_under_its_owner_name_keeps_its_data(
    model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    with serve(make_settings(model_dir, api_keys="old-key", data_dir=data, warmup=False)) as client:
        glossary, job = store_each(client, "old-key", segments=1)
    # Rotated: a new key, the name the old one had (what `python -m app.keys.accepted owner` prints).
    keys = write_keys(tmp_path, f'[[keys]]\nname = "{digest_name("old-key")}"\nkey = "new-key"\n')
    with serve(make_settings(model_dir, api_keys_file=keys, data_dir=data, warmup=False)) as client:
        assert holdings(client, "new-key") == ([glossary], 1, [job])
        assert client.get("/glossaries", headers={"X-API-Key": "old-key"}).status_code == 403
