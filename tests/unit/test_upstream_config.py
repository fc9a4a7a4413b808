"""Upstreams' configuration (flags, the TOML file, keys), key scrubbing, and the rollout's list
of upstream models from its request to its token."""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from fleet.api import convert
from fleet.api.pb import fleet_pb2, types_pb2
from fleet.core.errors import InvalidArgument
from fleet.core.manifest import Step, SubmitRequest, build_manifest, validate_request
from fleet.core.placement import Requirements
from fleet.core.tokens import issue, verify
from gateway.llm.upstream_config import REDACTED, load_upstreams, scrub

KEY = "sk-test-0123456789abcdef0123456789abcdef"
SECRET = b"t" * 32


def test_upstreams_from_flags_with_keys_from_the_environment_and_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UP_KEY", KEY)
    (tmp_path / "b.key").write_text("sk-other\n")
    config = load_upstreams(
        ["a=http://127.0.0.1:8000/v1/", "b=https://api.example.com/v1", "c=http://gpu:9/v1"],
        ["a=UP_KEY", f"b=@{tmp_path / 'b.key'}"],
        ["a/m=b/m,c/m"],
    )
    assert config.upstreams["a"].url == "http://127.0.0.1:8000/v1"
    assert config.upstreams["a"].key is not None
    assert config.upstreams["a"].key.get_secret_value() == KEY
    assert config.upstreams["b"].key is not None
    assert config.upstreams["b"].key.get_secret_value() == "sk-other"
    assert config.upstreams["c"].key is None
    assert config.fallbacks == {"a/m": ("b/m", "c/m")}
    assert sorted(config.keys()) == sorted([KEY, "sk-other"])
    assert KEY not in repr(config) and KEY not in str(config.upstreams)


def test_a_key_on_the_command_line_is_refused_without_being_repeated() -> None:
    with pytest.raises(InvalidArgument) as refused:
        load_upstreams(["a=http://127.0.0.1:8000/v1"], [f"a={KEY}"])
    assert "never taken on the command line" in str(refused.value)
    assert KEY not in str(refused.value)


@pytest.mark.parametrize(
    ("upstream", "key", "fallback", "says"),
    [
        (["a"], [], [], "--upstream 'a'…: expected NAME=URL"),
        (["-a=http://h/v1"], [], [], "upstream name '-a'"),
        (["a=ftp://h/v1"], [], [], "is not an http:// or https:// URL"),
        (["a=http://h/v1?x=1"], [], [], "query or fragment"),
        (["a=http://h/v1", "a=http://g/v1"], [], [], "--upstream a: registered twice"),
        (["a=http://h/v1"], ["b=B_KEY"], [], "--upstream-key 'b': no upstream of that name"),
        (["a=http://h/v1"], ["a=NO_SUCH_VARIABLE_SET"], [], "$NO_SUCH_VARIABLE_SET is empty"),
        (["a=http://h/v1"], ["a=@/nonexistent/key"], [], "cannot read the key file"),
        (["a=http://h/v1"], [], ["a/m=z/m"], "'z/m' names no upstream registered here"),
        (["a=http://h/v1"], [], ["a/m=a/m"], "a model is named twice in the chain"),
        (["a=http://h/v1"], [], ["m=a/m"], "'m' is not UPSTREAM/MODEL"),
    ],
)
def test_bad_upstream_flags_are_refused_naming_the_flag(
    upstream: list[str], key: list[str], fallback: list[str], says: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        load_upstreams(upstream, key, fallback)
    assert says in str(refused.value)


def test_credentials_in_an_upstream_url_are_refused_and_not_repeated() -> None:
    with pytest.raises(InvalidArgument) as refused:
        load_upstreams([f"a=https://user:{KEY}@api.example.com/v1"])
    assert "carries credentials" in str(refused.value) and KEY not in str(refused.value)


def test_upstreams_from_a_toml_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UP_KEY", KEY)
    (tmp_path / "b.key").write_text("sk-file\n")
    toml = tmp_path / "upstreams.toml"
    toml.write_text(
        "read_timeout_s = 30.0\nmax_connections = 8\n"
        '[upstreams.a]\nurl = "http://127.0.0.1:8000/v1"\nkey_env = "UP_KEY"\n'
        '[upstreams.b]\nurl = "http://127.0.0.1:8001/v1"\nkey_file = "b.key"\n'
        '[fallbacks]\n"a/m" = ["b/m"]\n'
    )
    config = load_upstreams(["c=http://127.0.0.1:8002/v1"], [], ["c/m=a/m"], toml)
    assert set(config.upstreams) == {"a", "b", "c"}
    assert config.upstreams["b"].key is not None
    assert config.upstreams["b"].key.get_secret_value() == "sk-file"  # relative to the file
    assert config.fallbacks == {"a/m": ("b/m",), "c/m": ("a/m",)}
    assert (config.read_timeout_s, config.max_connections, config.connect_timeout_s) == (30, 8, 5)


def test_a_key_written_in_the_toml_file_is_refused_and_not_repeated(tmp_path: Path) -> None:
    toml = tmp_path / "upstreams.toml"
    toml.write_text(f'[upstreams.a]\nurl = "http://127.0.0.1:8000/v1"\napi_key = "{KEY}"\n')
    with pytest.raises(InvalidArgument) as refused:
        load_upstreams(upstreams_file=toml)
    message = str(refused.value)
    assert "upstreams.a.api_key" in message and "key_env or key_file" in message
    assert KEY not in message


def test_scrub_replaces_every_echo_of_a_key() -> None:
    text = f'{{"error": "you sent Bearer {KEY}; again: {KEY}"}}'
    assert scrub(text, [KEY, ""]) == f'{{"error": "you sent Bearer {REDACTED}; again: {REDACTED}"}}'
    assert scrub("nothing here", [KEY]) == "nothing here"


def test_a_token_carries_the_rollouts_models_and_old_tokens_none() -> None:
    exp = time.time() + 60
    with_models = issue(SECRET, "r-1", exp, models=("up/a", "up/*"))
    assert verify(SECRET, with_models, time.time()).models == ("up/a", "up/*")
    plain = issue(SECRET, "r-1", exp)
    assert verify(SECRET, plain, time.time()).models == ()
    assert len(plain) < len(with_models)  # (no model list: the token is as before)


def _request(models: tuple[str, ...], inference: bool = True) -> SubmitRequest:
    return SubmitRequest(
        idempotency_key="k", smolfile='image = "minimal"\n', steps=(Step(argv=("true",)),),
        requirements=Requirements(inference=inference), models=models,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("models", "inference", "says"),
    [
        (("up/a",), False, "models: only a rollout that calls the inference gateway"),
        (("",), True, "models[0] is empty"),
        (("up/a", "local"), True, "models[1] 'local' is not UPSTREAM/MODEL"),
        (("up/a b",), True, "models[0] 'up/a b' is not UPSTREAM/MODEL"),
        (("up/" + "m" * 130,), True, "models[0] is 133 characters, over the limit of 128"),
        (tuple(f"up/m{i}" for i in range(17)), True, "models: 17 named, over the limit of 16"),
        (("up/a", "up/a"), True, "models: a model is named twice"),
    ],
)
def test_bad_model_lists_are_refused_naming_the_field(
    models: tuple[str, ...], inference: bool, says: str
) -> None:
    with pytest.raises(InvalidArgument) as refused:
        validate_request(_request(models, inference), datetime.now(UTC))
    assert says in str(refused.value)


def test_the_model_list_goes_from_the_request_to_the_manifest_and_back() -> None:
    now = datetime.now(UTC)
    pb = fleet_pb2.SubmitRolloutRequest(
        idempotency_key="k", smolfile='image = "minimal"\n',
        steps=[types_pb2.Step(argv=["true"])], models=["up/a", "hosted/*"],
        requirements=types_pb2.Requirements(inference=True),
    )  # fmt: skip
    request = convert.submit_from_pb(pb)
    assert request.models == ("up/a", "hosted/*")
    manifest = build_manifest(request, validate_request(request, now), "sha256:" + "0" * 64, now)
    assert manifest.models == ("up/a", "hosted/*")
    assert convert.manifest_from_pb(convert.manifest_to_pb(manifest)) == manifest
    # A manifest that names none keeps the digest it had before models existed.
    bare = manifest.model_copy(update={"models": ()})
    assert bare.digest != manifest.digest
    before = bare.model_dump_json(exclude={"smolfile_name", "inputs", "outputs", "session",
                                           "models", "max_prompt_tokens",
                                           "max_completion_tokens"})  # fmt: skip
    assert bare.digest == "sha256:" + hashlib.sha256(before.encode()).hexdigest()
    assert request.fingerprint() != request.model_copy(update={"models": ()}).fingerprint()
