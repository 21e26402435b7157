"""API keys and their limits as configured: ``NMT_API_KEYS``, the keys file ``NMT_API_KEYS_FILE``
and the ``NMT_KEY_*`` defaults (app/keys.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.config import describe_settings_error
from app.keys import KeysError, load_keys
from app.usage import KeyLimits
from tests.test_api import make_settings


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
        "env-one": "key1",
        "env-two": "key2",
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
        ("[[keys]]\nname = 'key1'\nkey = 'x'\n", "that of a key of NMT_API_KEYS"),
        ("[[keys]]\nname = 'a'\nkey = 'env-secret'\n", "same key as 'key1'"),
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
