"""Forwarding OpenAI-compatible requests to upstream servers, with the gateway's own keys.

A machine asks for `NAME/MODEL`; the gateway checks that its rollout's token allows that model
(the list signed into the token at submission, `fleet submit --model`), then sends the request
to upstream NAME as `MODEL`, with `Authorization: Bearer` the key the gateway holds for NAME
(never the rollout's token, which is the gateway's to check, not the upstream's). The answer
comes back with `model` the name the gateway serves it under, a `fleet` object saying which
upstream served and which were tried before it, and the `x-fleet-served-by` header.

Fallbacks (`UpstreamConfig.fallbacks`): an upstream that refuses the connection, times out,
answers 5xx, 429, 408, or refuses the gateway's key (401, 403) before the answer's first token
is skipped for the next model of the chain; a request the upstream itself refuses (another 4xx)
is the caller's to fix, and comes back as the upstream said it, scrubbed. Once a streamed
answer has sent tokens, it is never continued on another upstream: another model's (or the
same model's on another server's) continuation cannot be checked to be the one the first would
have given, so the stream ends with a resumable error naming the tokens sent and the last one,
and the caller resumes from the text it has.

Nothing an upstream says reaches a machine unscrubbed: any of the keys the gateway holds is
replaced in answers, chunks and error messages (`scrub`), and the keys are never logged.
Streams are relayed chunk by chunk as the upstream sends them; only what comes before the
first token is held back, so that a failure there can still fall back unseen.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog

from fleet.core.tokens import TokenClaims
from gateway.llm.openai_schema import ApiError, Reply
from gateway.llm.upstream_config import Upstream, UpstreamConfig, scrub

log = structlog.get_logger(__name__)

FORWARDED = ("/v1/chat/completions", "/v1/completions")
FALL_BACK_ON = frozenset({401, 403, 408, 429})
"""Statuses, besides 5xx, after which the next model of the chain is tried."""
MAX_ERROR_BYTES = 64 * 1024
"""Of an upstream's error body, what is read (the rest is not needed to summarise it)."""
LIST_TIMEOUT_S = 5.0
"""How long /v1/models waits for an upstream's own list."""


class _Failed(Exception):
    """An upstream failed before its answer's first token: the chain moves on."""


@dataclass
class _Attempt:
    """What the chain has tried so far, for the answer's `fleet` object."""

    requested: str
    tried: list[dict[str, str]] = field(default_factory=list)

    def fleet(self, model: str) -> dict[str, Any]:
        return {
            "served_by": "upstream",
            "upstream": model.partition("/")[0],
            "model": model,
            "requested": self.requested,
            "fallbacks_tried": list(self.tried),
            "degraded": bool(self.tried),
        }

    def headers(self, model: str) -> dict[str, str]:
        return {
            "x-fleet-served-by": f"upstream; upstream={model.partition('/')[0]}; model={model}",
            "x-fleet-degraded": "1" if self.tried else "0",
            "x-fleet-fallbacks": ",".join(t["model"] for t in self.tried) or "none",
        }


class Upstreams:
    """The registered upstreams, one connection pool for all of them (`aclose` at the end)."""

    def __init__(self, config: UpstreamConfig, transport: httpx.AsyncBaseTransport | None = None):
        self.config = config
        self._keys = config.keys()
        timeout = httpx.Timeout(
            config.read_timeout_s, connect=config.connect_timeout_s, pool=config.connect_timeout_s
        )
        limits = httpx.Limits(
            max_connections=config.max_connections,
            max_keepalive_connections=min(32, config.max_connections),
        )
        # Not from the environment: no proxy, .netrc or CA bundle the operator did not choose
        # is applied to requests that carry the gateway's keys.
        self.client = httpx.AsyncClient(
            timeout=timeout,
            limits=limits,
            trust_env=False,
            follow_redirects=False,
            transport=transport,
        )
        log.info(
            "upstreams_registered",
            upstreams={n: ("key" if u.key else "no key") for n, u in config.upstreams.items()},
            fallbacks={m: list(c) for m, c in config.fallbacks.items()},
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    def scrub(self, text: str) -> str:
        return scrub(text, self._keys)

    def serves(self, model: str) -> bool:
        """`model` is NAME/MODEL of an upstream registered here."""
        name, slash, rest = model.partition("/")
        return bool(slash and rest) and name in self.config.upstreams

    def request_of(self, path: str, body: bytes) -> dict[str, Any] | None:
        """The request's JSON when it is one to forward (its `model` names an upstream); None
        when the gateway's own model serves it (or the local path's checks refuse it)."""
        if path not in FORWARDED or not self.config.upstreams:
            return None
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if isinstance(data, dict) and isinstance(data.get("model"), str):
            return data if self.serves(data["model"]) else None
        return None

    @staticmethod
    def allowed(claims: TokenClaims, model: str) -> bool:
        return model in claims.models or f"{model.partition('/')[0]}/*" in claims.models

    def check_allowed(self, claims: TokenClaims, model: str) -> None:
        """403 in OpenAI's shape, naming the model, unless the rollout's token allows it."""
        if not self.allowed(claims, model):
            listed = ", ".join(claims.models) or "none"
            raise ApiError(
                403,
                f"model {model!r} is not among the upstream models rollout "
                f"{claims.rollout_id} may use ({listed}); a rollout names them at submission "
                f"(fleet submit --model {model})",
                "permission_error",
                param="model",
                code="model_not_allowed",
            )

    # -- forwarding ------------------------------------------------------------------------

    async def forward(self, path: str, claims: TokenClaims, request: dict[str, Any]) -> Reply:
        """The request answered by the first model of its chain that answers."""
        requested = str(request["model"])
        self.check_allowed(claims, requested)
        attempt = _Attempt(requested)
        chain = (requested, *self.config.fallbacks.get(requested, ()))
        stream = request.get("stream") is True
        for model in chain:
            upstream = self.config.upstreams[model.partition("/")[0]]
            body = {**request, "model": model.partition("/")[2]}
            bound = log.bind(rollout_id=claims.rollout_id, upstream=upstream.name, model=model)
            try:
                if stream:
                    return await self._stream(upstream, path, body, model, attempt)
                return await self._whole(upstream, path, body, model, attempt)
            except _Failed as exc:
                why = self.scrub(str(exc))
                bound.warning("upstream_failed", error=why, next_in_chain=model != chain[-1])
                attempt.tried.append({"model": model, "error": why})
        summary = "; ".join(f"{t['model']}: {t['error']}" for t in attempt.tried)
        error = ApiError(
            503,
            f"no upstream answered for {requested!r} ({summary})",
            "service_unavailable_error",
            code="upstream_unavailable",
            retry_after_s=1.0,
        )
        reply = error.reply()
        assert reply.body is not None
        reply.body["fleet"] = {**attempt.fleet(requested), "served_by": "none"}
        reply.headers.update(attempt.headers(requested))
        return reply

    def _request(self, upstream: Upstream, path: str, body: dict[str, Any]) -> httpx.Request:
        headers = {"content-type": "application/json", "accept": "application/json"}
        if body.get("stream") is True:
            headers["accept"] = "text/event-stream"
        if upstream.key is not None:
            headers["authorization"] = f"Bearer {upstream.key.get_secret_value()}"
        url = upstream.url + path.removeprefix("/v1")
        return self.client.build_request("POST", url, json=body, headers=headers)

    async def _send(self, upstream: Upstream, path: str, body: dict[str, Any]) -> httpx.Response:
        """The upstream's response (its body not yet read), or _Failed for one the chain moves
        on from; another refusal (the request's own fault) is raised as the upstream said it."""
        try:
            response = await self.client.send(self._request(upstream, path, body), stream=True)
        except httpx.TransportError as exc:
            raise _Failed(_transport_error(exc)) from None
        if response.status_code == 200:
            return response
        try:
            raw = await _read_at_most(response, MAX_ERROR_BYTES)
        except httpx.TransportError as exc:
            raise _Failed(f"HTTP {response.status_code}, then {_transport_error(exc)}") from None
        finally:
            await response.aclose()
        said = self.scrub(_error_message(raw))
        if response.status_code >= 500 or response.status_code in FALL_BACK_ON:
            raise _Failed(f"HTTP {response.status_code}: {said}")
        raise ApiError(
            response.status_code,
            f"upstream {upstream.name}: {said}",
            "invalid_request_error",
            code="upstream_refused",
        )

    async def _whole(
        self, upstream: Upstream, path: str, body: dict[str, Any], model: str, attempt: _Attempt
    ) -> Reply:
        response = await self._send(upstream, path, body)
        try:
            raw = await response.aread()
        except httpx.TransportError as exc:
            raise _Failed(f"the answer broke off: {_transport_error(exc)}") from None
        finally:
            await response.aclose()
        try:
            answer = json.loads(self.scrub(raw.decode()))
        except (ValueError, UnicodeDecodeError):
            raise _Failed("the answer is not JSON") from None
        if not isinstance(answer, dict):
            raise _Failed("the answer is not a JSON object")
        answer["model"] = model
        answer["fleet"] = attempt.fleet(model)
        log.info(
            "upstream_answered",
            upstream=upstream.name,
            model=model,
            stream=False,
            fallbacks=len(attempt.tried),
        )
        return Reply(200, answer, headers=attempt.headers(model))

    async def _stream(
        self, upstream: Upstream, path: str, body: dict[str, Any], model: str, attempt: _Attempt
    ) -> Reply:
        """Reads the stream up to its first token (a failure there moves the chain on), then
        answers with a relay of the rest."""
        response = await self._send(upstream, path, body)
        relay = _Relay(self, response, model, attempt)
        try:
            await relay.first_token()
        except BaseException:
            await response.aclose()
            raise
        log.info(
            "upstream_answering",
            upstream=upstream.name,
            model=model,
            stream=True,
            fallbacks=len(attempt.tried),
        )
        return Reply(200, events=relay, headers=attempt.headers(model))

    # -- GET /v1/models ----------------------------------------------------------------------

    async def models(self, claims: TokenClaims) -> list[dict[str, Any]]:
        """The upstream models the rollout may use, as each upstream lists them; an upstream
        that does not answer in LIST_TIMEOUT_S is left out of the list (and logged)."""
        names = [
            n for n in self.config.upstreams if any(m.partition("/")[0] == n for m in claims.models)
        ]
        listed = await asyncio.gather(*(self._list(n) for n in names))
        out = []
        for name, ids in zip(names, listed, strict=True):
            for model_id in ids:
                model = f"{name}/{model_id}"
                if self.allowed(claims, model):
                    out.append(
                        {
                            "id": model,
                            "object": "model",
                            "created": 0,
                            "owned_by": name,
                            "fleet": {
                                "served_by": "upstream",
                                "upstream": name,
                                "fallbacks": list(self.config.fallbacks.get(model, ())),
                            },
                        }
                    )
        return out

    async def _list(self, name: str) -> list[str]:
        upstream = self.config.upstreams[name]
        headers = {"accept": "application/json"}
        if upstream.key is not None:
            headers["authorization"] = f"Bearer {upstream.key.get_secret_value()}"
        try:
            response = await self.client.get(
                upstream.url + "/models", headers=headers, timeout=LIST_TIMEOUT_S
            )
            data = response.json()["data"] if response.status_code == 200 else None
            if not isinstance(data, list):
                raise ValueError(f"HTTP {response.status_code}")
            return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m][:1000]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.warning("upstream_models_unlisted", upstream=name, error=self.scrub(str(exc)))
            return []


class _Relay:
    """A streamed answer relayed chunk by chunk: each `data:` payload with `model` and `fleet`
    set, scrubbed. The chunks before the first token are held (`first_token`), so that a failure
    before it is the chain's to handle; after it, a failure ends the stream with a resumable
    error. `aclose` closes the upstream's response, whether the relay was read or not."""

    def __init__(
        self, ups: Upstreams, response: httpx.Response, model: str, attempt: _Attempt
    ) -> None:
        self.ups = ups
        self.response = response
        self.model = model
        self.fleet = attempt.fleet(model)
        self.held: list[str] = []
        self.lines = response.aiter_lines()
        self.sent = 0
        """Chunks that carried a token (text, a tool call or a finish), relayed."""
        self.last_token = ""
        self.done = False

    def _chunk(self, payload: str) -> tuple[str, bool]:
        """The payload to relay, and whether it carries a token."""
        if payload == "[DONE]":
            return payload, False
        try:
            chunk = json.loads(self.ups.scrub(payload))
        except ValueError:
            return self.ups.scrub(payload), False
        if not isinstance(chunk, dict):
            return json.dumps(chunk), False
        if "error" in chunk:  # the upstream reports a failure in the stream
            raise _Failed(f"the upstream's stream says: {_error_message(payload.encode())}")
        chunk["model"] = self.model
        chunk["fleet"] = self.fleet
        token = ""
        carries = False
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice["delta"] if isinstance(choice.get("delta"), dict) else {}
            text = delta.get("content") or choice.get("text") or ""
            if text or delta.get("tool_calls") or choice.get("finish_reason"):
                carries = True
                token = str(text) or token
        if carries and token:
            self.last_token = token
        return json.dumps(chunk), carries

    async def _next_payload(self) -> str:
        """The next `data:` payload; _Failed when the stream breaks off or ends without
        `[DONE]` (an upstream that died mid-answer, whatever its framing made it look like)."""
        try:
            async for line in self.lines:
                if line.startswith("data:"):
                    return line[5:].strip()
        except httpx.TransportError as exc:
            raise _Failed(f"the stream broke off: {_transport_error(exc)}") from None
        raise _Failed("the stream ended without [DONE]")

    async def first_token(self) -> None:
        while True:
            payload, carries = self._chunk(await self._next_payload())
            self.held.append(payload)
            if payload == "[DONE]":
                self.done = True
                return
            if carries:
                self.sent = 1
                return

    def __aiter__(self) -> _Relay:
        return self

    async def __anext__(self) -> str:
        if self.held:
            return self.held.pop(0)
        if self.done:
            raise StopAsyncIteration
        try:
            payload, carries = self._chunk(await self._next_payload())
        except _Failed as exc:
            self.done = True
            return json.dumps(self._resumable(self.ups.scrub(str(exc))))
        if payload == "[DONE]":
            self.done = True
        self.sent += carries
        return payload

    def _resumable(self, why: str) -> dict[str, Any]:
        log.warning("upstream_stream_broke", model=self.model, tokens_sent=self.sent, error=why)
        error = {
            "message": f"upstream model {self.model} failed after {self.sent} tokens were "
            f"sent ({why}); it is not continued elsewhere, since no other model's "
            "continuation can be checked to be the same: resume from the text received",
            "type": "service_unavailable_error",
            "param": None,
            "code": "resumable",
        }
        return {
            "error": error,
            "fleet": {
                **self.fleet,
                "resumable": True,
                "tokens_sent": self.sent,
                "last_token_index": self.sent - 1,
                "last_token": self.last_token,
            },
        }

    async def aclose(self) -> None:
        self.done = True
        await self.response.aclose()


async def _read_at_most(response: httpx.Response, limit: int) -> bytes:
    out = bytearray()
    async for piece in response.aiter_bytes():
        out += piece
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def _error_message(raw: bytes) -> str:
    """An upstream's error, summarised: OpenAI's `error.message` when it sent one, else the
    start of what it sent."""
    text = raw.decode(errors="replace")
    try:
        data = json.loads(text)
        message = data["error"]["message"] if isinstance(data["error"], dict) else data["error"]
        text = str(message)
    except (ValueError, KeyError, TypeError):
        pass
    text = " ".join(text.split())
    return text[:300] + ("…" if len(text) > 300 else "") or "(no message)"


def _transport_error(exc: httpx.TransportError) -> str:
    kinds = {
        httpx.ConnectError: "connection refused or unreachable",
        httpx.ConnectTimeout: "connect timed out",
        httpx.ReadTimeout: "read timed out",
        httpx.PoolTimeout: "no free connection to it in time",
        httpx.RemoteProtocolError: "it broke the protocol (closed mid-answer?)",
    }
    for kind, text in kinds.items():
        if isinstance(exc, kind):
            return text
    return type(exc).__name__
