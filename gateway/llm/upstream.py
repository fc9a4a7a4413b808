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

The relay of a stream (`gateway.llm.upstream_relay`) passes the upstream's chunks on as it
wrote them and reads each body to its end, so that connections are kept. Each upstream has a
pool of its own (`gateway.llm.upstream_http`: asyncio protocols, llhttp's compiled parser),
whose requests are bytes made ready per upstream and whose streams, after their first token,
are relayed inside each connection's `data_received`; a stream's silences are bounded by one
watch for all streams (`upstream_relay.ReadWatch`) rather than a timer re-armed per chunk.
With a burst of streams, each request's set-up and each chunk's handling wait behind the
others' on one event loop, so their cost is the latency the proxy adds (aiohttp's client
here, before: about 7 ms of the gateway's CPU per proxied stream of 64 chunks; this one: 5).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import structlog

from fleet.core.tokens import TokenClaims
from gateway.llm.openai_schema import ApiError, Reply
from gateway.llm.upstream_config import Upstream, UpstreamConfig, scrub
from gateway.llm.upstream_http import Pool, Response
from gateway.llm.upstream_relay import (
    NETWORK_ERRORS,
    Failed,
    ReadWatch,
    Relay,
    StreamUsage,
    error_message,
    transport_error,
)

log = structlog.get_logger(__name__)

FORWARDED = ("/v1/chat/completions", "/v1/completions")
FALL_BACK_ON = frozenset({401, 403, 408, 429})
"""Statuses, besides 5xx, after which the next model of the chain is tried."""
MAX_ERROR_BYTES = 64 * 1024
"""Of an upstream's error body, what is read (the rest is not needed to summarise it)."""
LIST_TIMEOUT_S = 5.0
"""How long /v1/models waits for an upstream's own list."""
MAX_LIST_BYTES = 4 << 20
"""Of an upstream's own list, what is read."""
MAX_ANSWER_BYTES = 64 << 20
"""Of a whole (not streamed) answer, the most taken: past it the upstream counts as failed."""


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
    """The registered upstreams, a connection pool for each (`aclose` at the end)."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self._keys = config.keys()
        self._pools: dict[str, Pool] = {}
        self._watch = ReadWatch(config.read_timeout_s)
        # Each request's headers, made once per upstream (whole answers, streams): they are
        # the same for every request, and a request's set-up is paid by every stream of a
        # burst one after another on the one event loop.
        self._headers = {
            (name, stream): _request_headers(upstream, stream)
            for name, upstream in config.upstreams.items()
            for stream in (False, True)
        }
        log.info(
            "upstreams_registered",
            upstreams={n: ("key" if u.key else "no key") for n, u in config.upstreams.items()},
            fallbacks={m: list(c) for m, c in config.fallbacks.items()},
        )

    def pool(self, name: str) -> Pool:
        """Upstream `name`'s connections, made on first use (on the event loop that serves):
        up to `max_connections` open at once, each kept alive between requests, so that a
        burst of streams reuses the last burst's connections. `connect_timeout_s` bounds the
        wait for a free connection and the connect itself, `read_timeout_s` the wait for an
        answer's head (and, through the watch, the silence between two chunks). Nothing is
        taken from the environment (no proxy or .netrc the operator did not choose is applied
        to requests that carry the gateway's keys), no cookies are kept, TLS is verified
        against the system's CA store, and redirects are never followed."""
        pool = self._pools.get(name)
        if pool is None or pool.closed:
            config = self.config
            upstream = config.upstreams[name]
            key = upstream.key.get_secret_value() if upstream.key is not None else None
            pool = self._pools[name] = Pool(
                upstream.url,
                {
                    "user-agent": "fleet-gateway",
                    **({"authorization": f"Bearer {key}"} if key else {}),
                },
                max_connections=config.max_connections,
                connect_timeout_s=config.connect_timeout_s,
                head_timeout_s=config.read_timeout_s,
            )
        return pool

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        await self._watch.aclose()
        for pool in pools:
            pool.close()

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

    async def forward(
        self,
        path: str,
        claims: TokenClaims,
        request: dict[str, Any],
        usage: StreamUsage | None = None,
    ) -> Reply:
        """The request answered by the first model of its chain that answers; a stream's
        tokens counted in `usage` as they are relayed."""
        requested = str(request["model"])
        self.check_allowed(claims, requested)
        attempt = _Attempt(requested)
        chain = (requested, *self.config.fallbacks.get(requested, ()))
        stream = request.get("stream") is True
        for model in chain:
            name, _, upstream_model = model.partition("/")
            upstream = self.config.upstreams[name]
            body = {**request, "model": upstream_model}
            try:
                if stream:
                    return await self._stream(upstream, path, body, model, attempt, usage)
                return await self._whole(upstream, path, body, model, attempt)
            except Failed as exc:
                why = self.scrub(str(exc))
                log.warning(
                    "upstream_failed", rollout_id=claims.rollout_id, upstream=name, model=model,
                    error=why, next_in_chain=model != chain[-1],
                )  # fmt: skip
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

    async def _send(self, upstream: Upstream, path: str, body: dict[str, Any]) -> Response:
        """The upstream's response (its body not yet read), or Failed for one the chain moves
        on from; another refusal (the request's own fault) is raised as the upstream said it."""
        headers = self._headers[upstream.name, body.get("stream") is True]
        data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        try:
            response = await self.pool(upstream.name).request(
                "POST", path.removeprefix("/v1"), data, headers=headers
            )
        except NETWORK_ERRORS as exc:
            raise Failed(transport_error(exc)) from None
        if response.status == 200:
            return response
        try:
            raw = await response.read(MAX_ERROR_BYTES)
        except NETWORK_ERRORS as exc:
            raise Failed(f"HTTP {response.status}, then {transport_error(exc)}") from None
        finally:
            response.release()
        said = self.scrub(error_message(raw))
        if response.status >= 500 or response.status in FALL_BACK_ON:
            raise Failed(f"HTTP {response.status}: {said}")
        raise ApiError(
            response.status,
            f"upstream {upstream.name}: {said}",
            "invalid_request_error",
            code="upstream_refused",
        )

    async def _whole(
        self, upstream: Upstream, path: str, body: dict[str, Any], model: str, attempt: _Attempt
    ) -> Reply:
        response = await self._send(upstream, path, body)
        try:
            raw = await response.read(MAX_ANSWER_BYTES, strict=True)
        except NETWORK_ERRORS as exc:
            raise Failed(f"the answer broke off: {transport_error(exc)}") from None
        finally:
            response.release()
        try:
            answer = json.loads(self.scrub(raw.decode()))
        except (ValueError, UnicodeDecodeError):
            raise Failed("the answer is not JSON") from None
        if not isinstance(answer, dict):
            raise Failed("the answer is not a JSON object")
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
        self, upstream: Upstream, path: str, body: dict[str, Any], model: str, attempt: _Attempt,
        usage: StreamUsage | None,
    ) -> Reply:  # fmt: skip
        """Reads the stream up to its first token (a failure there moves the chain on), then
        answers with a relay of the rest."""
        response = await self._send(upstream, path, body)
        relay = Relay(response, model, attempt.fleet(model), self.scrub, usage, self._watch)
        try:
            await relay.first_token()
        except BaseException:
            response.close()
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
        try:
            async with asyncio.timeout(LIST_TIMEOUT_S):
                response = await self.pool(name).request(
                    "GET", "/models", headers=b"accept: application/json\r\n"
                )
                try:
                    status = response.status
                    raw = await response.read(MAX_LIST_BYTES) if status == 200 else b""
                finally:
                    response.release()
            data = json.loads(raw)["data"] if status == 200 else None
            if not isinstance(data, list):
                raise ValueError(f"HTTP {status}")
            return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m][:1000]
        except (*NETWORK_ERRORS, ValueError, KeyError, TypeError) as exc:
            why = transport_error(exc) if isinstance(exc, NETWORK_ERRORS) else str(exc)
            log.warning("upstream_models_unlisted", upstream=name, error=self.scrub(why))
            return []


def _request_headers(upstream: Upstream, stream: bool) -> bytes:
    """The headers of every request to `upstream` besides those of its pool (the gateway's key
    for it, never the rollout's token; `Upstreams.pool`), as they are written."""
    accept = "text/event-stream" if stream else "application/json"
    return f"content-type: application/json\r\naccept: {accept}\r\n".encode()
