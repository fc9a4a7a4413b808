"""Every statement the ledger runs, by name.

Written once for both backends and run only through `fleet.ledger.raw.Raw`:

- `?` placeholders (PostgreSQL gets `%s`);
- row locks as PostgreSQL takes them (`FOR UPDATE`, `FOR UPDATE SKIP LOCKED`); SQLite runs
  without them, its write transaction holding the whole database from BEGIN IMMEDIATE on;
- `{marks}` where a statement takes a list of values, filled in with as many placeholders as
  the caller's `n=` says;
- a flag that turns a condition off is a placeholder of its own: `(? OR tenant = ?)` with True
  matches every tenant.

The columns a statement selects for a record are the record's fields
(`fleet.ledger.records`), in order.
"""

from __future__ import annotations

from fleet.ledger.records import AttemptRec, Item, RolloutRec, columns

ITEM_COLS = columns(Item)
ROLLOUT_COLS = columns(RolloutRec)
ATTEMPT_COLS = columns(AttemptRec, "a")

# -- rollouts ------------------------------------------------------------------------------

ROLLOUT = f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE id = ?"
ROLLOUT_FOR_UPDATE = ROLLOUT + " FOR UPDATE"
ROLLOUTS_BY_KEY = (
    "SELECT id, idempotency_key, request_fingerprint FROM rollouts "
    "WHERE idempotency_key IN ({marks})"
)
INSERT_ROLLOUT = (
    "INSERT INTO rollouts (id, idempotency_key, request_fingerprint, manifest_digest, tenant, "
    "labels_json, state, priority, attempts, error, host_id, runtime, device, results_json, "
    "egress_json, cpu_s, created_at, updated_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, '', '', '', '', '[]', '', 0, ?, ?)"
)
INSERT_LABEL = "INSERT INTO rollout_labels (rollout_id, key, value) VALUES (?, ?, ?)"
MOVE_ROLLOUT = (
    "UPDATE rollouts SET state = ?, updated_at = ?, started_at = ?, finished_at = ?, error = ? "
    "WHERE id = ?"
)
SET_ROLLOUT_ERROR = "UPDATE rollouts SET error = ? WHERE id = ?"
RUN_ROLLOUT = (
    "UPDATE rollouts SET state = 'RUNNING', attempts = ?, updated_at = ?, started_at = ? "
    "WHERE id = ?"
)
"""A claim: the rollout runs its next attempt."""
CLAIMED_ROLLOUTS = (
    "SELECT id, state, manifest_digest, started_at FROM rollouts WHERE id IN ({marks}) "
    "ORDER BY id FOR UPDATE"
)
REPORTED_ROLLOUTS = (
    "SELECT id, state, manifest_digest, error FROM rollouts WHERE id IN ({marks}) "
    "ORDER BY id FOR UPDATE"
)
REPORT_ROLLOUT = (
    "UPDATE rollouts SET state = ?, error = ?, host_id = ?, runtime = ?, device = ?, "
    "results_json = ?, egress_json = ?, updated_at = ?, finished_at = ?, cpu_s = cpu_s + ?, "
    "outputs_json = ? WHERE id = ?"
)
LABELS = "{labels}"
"""Where `LIST_ROLLOUTS` takes its filters: the `AND_...` conditions below that apply."""
LIST_ROLLOUTS = (
    f"SELECT {ROLLOUT_COLS} FROM rollouts WHERE seq < ?" + LABELS + " ORDER BY seq DESC LIMIT ?"
)
"""A page of rollouts, newest first, before a seq. A filter that does not apply is left out of
the statement rather than switched off by a flag, so that PostgreSQL plans each page on the
index that serves it (ix_rollouts_tenant_seq, ix_rollouts_state_seq) even as a prepared
statement's generic plan."""
AND_TENANT = " AND tenant = ?"
AND_STATE = " AND state = ?"
AND_CREATED_SINCE = " AND created_at >= ?"
AND_CREATED_BEFORE = " AND created_at < ?"
AND_EGRESS_KNOWN = " AND egress_json <> ''"
AND_LABELLED = " AND id IN (SELECT rollout_id FROM rollout_labels WHERE key = ? AND value = ?)"
ROLLOUTS_IN_STATE = "SELECT id, manifest_digest FROM rollouts WHERE state = ?"
FINISHED_SINCE = "SELECT count(*) FROM rollouts WHERE state = ? AND finished_at >= ?"
UNFINISHED_BY_STATE = "SELECT state, count(*) FROM rollouts WHERE state IN ({marks}) GROUP BY state"
"""Rollouts not final yet, by state (the states listed; ix_rollouts_state_finished)."""
FINISHED_FIGURES = (
    "SELECT state, count(*), "
    "coalesce(sum(CASE WHEN attempts > 1 THEN attempts - 1 ELSE 0 END), 0), "
    "coalesce(sum(cpu_s), 0) FROM rollouts "
    "WHERE state IN ({marks}) AND finished_at >= ? AND finished_at < ? GROUP BY state"
)
"""Final rollouts that finished in [from, until), by state: how many, their attempts beyond
the first, their CPU seconds (the final states listed; ix_rollouts_state_finished)."""
FINISHED_CALLING_INFERENCE = (
    "SELECT count(*) FROM rollouts r JOIN work_items w ON w.rollout_id = r.id "
    "WHERE r.state IN ({marks}) AND r.finished_at >= ? AND r.finished_at < ? "
    "AND w.needs_inference = ?"
)
"""Of those, how many called the gateway (their work items, done with them)."""
ROLLOUT_OUTPUTS = "SELECT outputs_json FROM rollouts WHERE outputs_json <> '[]'"
MANIFEST_DIGEST = "SELECT manifest_digest FROM rollouts WHERE id = ?"

# -- manifests, events, artifacts ----------------------------------------------------------

MANIFEST_BODIES = "SELECT digest, body FROM manifests WHERE digest IN ({marks})"
INSERT_MANIFEST = (
    "INSERT INTO manifests (digest, body, created_at) VALUES (?, ?, ?) ON CONFLICT DO NOTHING"
)
MANIFESTS_WITH_INPUTS = "SELECT body FROM manifests WHERE body LIKE '%\"inputs\":[{%'"
INSERT_EVENT = (
    "INSERT INTO events (rollout_id, kind, from_state, to_state, actor, at, message, attempt) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
EVENTS_AFTER = (
    "SELECT seq, kind, from_state, to_state, actor, at, message, attempt FROM events "
    "WHERE rollout_id = ? AND seq > ? ORDER BY seq LIMIT ?"
)
INSERT_EGRESS_EVENT = (
    "INSERT INTO egress_events (rollout_id, attempt, machine, at, kind, destination, decision, "
    "reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
EGRESS_EVENTS = (
    "SELECT attempt, at, machine, kind, destination, decision, reason FROM egress_events "
    "WHERE rollout_id = ? ORDER BY seq"
)
ARTIFACT = "SELECT data FROM artifacts WHERE digest = ?"
INSERT_ARTIFACT = (
    "INSERT INTO artifacts (digest, size_bytes, data, created_at) VALUES (?, ?, ?, ?) "
    "ON CONFLICT DO NOTHING"
)

# -- work items and leases -----------------------------------------------------------------

INSERT_WORK_ITEM = (
    "INSERT INTO work_items (id, rollout_id, tenant, state, host_class, needs_vm, "
    "needs_namespace, needs_cuda_device, needs_inference, priority, attempt, max_attempts, "
    "not_before, deadline, lease_owner, fencing_token, cancel_requested, result_fingerprint, "
    "claim_request_id, pin_host) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?, ?, ?, '', 0, ?, '', '', ?)"
)
ITEM_FOR_UPDATE = f"SELECT {ITEM_COLS} FROM work_items WHERE id = ? FOR UPDATE"
ITEMS_FOR_UPDATE = (
    f"SELECT {ITEM_COLS} FROM work_items WHERE id IN ({{marks}}) ORDER BY id FOR UPDATE"
)
ITEM_OF_ROLLOUT_FOR_UPDATE = f"SELECT {ITEM_COLS} FROM work_items WHERE rollout_id = ? FOR UPDATE"
CLAIMABLE = (
    f"SELECT {ITEM_COLS} FROM work_items "
    "WHERE state = ? AND host_class IN (?, ?) AND not_before <= ? AND deadline > ? "
    "AND pin_host IN ('', ?) "
    # The host that failed an attempt (a host error, a lost lease) gets its retry only once
    # others had AVOID_HOST_S to take it, unless no other live host of its class could (one
    # that beat within the last AVOID_HOST_S): a lone host runs it at once.
    "AND (avoid_host <> ? OR not_before <= ? OR NOT EXISTS (SELECT 1 FROM hosts "
    "WHERE hosts.host_class = work_items.host_class AND hosts.id <> ? "
    "AND hosts.last_heartbeat_at > ?)) "
    "AND (? OR NOT needs_vm) AND (? OR NOT needs_namespace) "
    "AND (? OR NOT needs_cuda_device) AND (? OR NOT needs_inference) "
    "AND tenant NOT IN ({marks}) "
    "ORDER BY priority DESC, not_before, id LIMIT ? FOR UPDATE SKIP LOCKED"
)
"""What a host may lease, in lease order (ix_work_items_claim): queued, of its classes, due,
before its deadline, not pinned elsewhere, not avoiding it, needing nothing it lacks (the three
flags: it has a VM, a CUDA device, the gateway), of no tenant at its cap."""
CLAIM_IN_LEASE_ORDER = "SELECT set_config('enable_sort', 'off', true)"
"""PostgreSQL only, before `CLAIMABLE`, for the rest of the transaction: read the claim index in
lease order and stop at the LIMIT, never fetch every due item and sort them. The planner picks
that sort when its statistics say the queue is small: a burst of submissions to a quiet table,
before autovacuum's next ANALYZE, made every claim of 32 sort the whole queue (3,000 items:
10 ms instead of 0.2). Reading the index in order is never the worse plan: the sort must read
every row that the ordered scan may stop before."""
SAVEPOINT = "SAVEPOINT one_of_many"
"""Where one of many changes in a transaction begins (a claim of a batch): `ROLLBACK_TO_SAVEPOINT`
undoes that one alone, and `RELEASE_SAVEPOINT` ends it either way."""
ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT one_of_many"
RELEASE_SAVEPOINT = "RELEASE SAVEPOINT one_of_many"
LEASES_OF_CLAIM = (
    f"SELECT {ITEM_COLS} FROM work_items WHERE lease_owner = ? AND state = ? "
    "AND claim_request_id = ?"
)
LEASE_ITEM = (
    "UPDATE work_items SET state = 'LEASED', attempt = ?, fencing_token = ?, lease_owner = ?, "
    "lease_expires_at = ?, claim_request_id = ?, result_fingerprint = '' WHERE id = ?"
)
SET_LEASE_EXPIRY = "UPDATE work_items SET lease_expires_at = ? WHERE id = ?"
EXPIRE_LEASES_OF_HOST = (
    "UPDATE work_items SET lease_expires_at = ? WHERE lease_owner = ? AND state = ?"
)
LEASED_TO_HOST = "SELECT id FROM work_items WHERE state = ? AND lease_owner = ? ORDER BY id"
LEASES_OF_HOST = "SELECT count(*) FROM work_items WHERE lease_owner = ? AND state = ?"
LEASES_BY_HOST = "SELECT lease_owner, count(*) FROM work_items WHERE state = ? GROUP BY lease_owner"
LEASES_BY_TENANT = "SELECT tenant, count(*) FROM work_items WHERE state = ? GROUP BY tenant"
ACTIVE_OF_TENANTS = "SELECT tenant, active FROM tenant_active WHERE tenant IN ({marks})"
"""Queued plus leased work items of these tenants (a tenant with none may have no row)."""
COUNT_ACTIVE = (
    "INSERT INTO tenant_active (tenant, active) VALUES (?, ?) ON CONFLICT (tenant) "
    "DO UPDATE SET active = tenant_active.active + excluded.active"
)
"""Adds to a tenant's count of queued plus leased items (negative: items that ended), in the
same transaction as the change, so the count is always the items' own."""
EXPIRED_LEASES = (
    f"SELECT {ITEM_COLS} FROM work_items WHERE state = ? AND lease_expires_at < ? "
    "FOR UPDATE SKIP LOCKED"
)
EXPIRED_LEASES_OF_HOSTS_SEEN = (
    f"SELECT {ITEM_COLS} FROM work_items WHERE state = ? AND lease_expires_at < ? "
    "AND lease_owner IN (SELECT id FROM hosts WHERE last_heartbeat_at >= ?) "
    "FOR UPDATE SKIP LOCKED"
)
"""`EXPIRED_LEASES` of hosts that beat (or registered) since a time: what a server that has
just started may judge (their hosts reached it, so their leases' state is known: a lease
released by its host, say)."""
LATE_ITEMS = (
    f"SELECT {ITEM_COLS} FROM work_items WHERE state = ? AND deadline <= ? FOR UPDATE SKIP LOCKED"
)
RELEASE_LEASE = (
    "UPDATE work_items SET state = ?, not_before = ?, lease_owner = '', lease_expires_at = NULL, "
    "avoid_host = ? WHERE id = ?"
)
"""A lost lease: queued again or done; the host that lost it is avoided by the retry."""
REPORT_ITEM = (
    "UPDATE work_items SET state = ?, lease_owner = ?, lease_expires_at = NULL, not_before = ?, "
    "result_fingerprint = ?, avoid_host = ? WHERE id = ?"
)
SET_ITEM_STATE = "UPDATE work_items SET state = ? WHERE id = ?"
REQUEST_CANCEL = "UPDATE work_items SET cancel_requested = TRUE WHERE id = ?"
WORK_LEASE = (
    "SELECT w.lease_owner, w.fencing_token, r.manifest_digest, r.tenant FROM work_items w "
    "JOIN rollouts r ON r.id = w.rollout_id WHERE w.id = ? AND w.state = ?"
)
ROLLOUT_LEASE = "SELECT id, lease_owner FROM work_items WHERE rollout_id = ? AND state = ?"
QUEUED_OF_CLASS = "SELECT count(*) FROM work_items WHERE state = ? AND host_class = ?"

# -- attempts ------------------------------------------------------------------------------

INSERT_ATTEMPT = (
    "INSERT INTO attempts (work_id, attempt, host_id, fencing_token, started_at, outcome, error) "
    "VALUES (?, ?, ?, ?, ?, '', '')"
)
END_ATTEMPT = (
    "UPDATE attempts SET ended_at = ?, outcome = ?, error = ? WHERE work_id = ? AND attempt = ?"
)
REPORT_ATTEMPT = (
    "UPDATE attempts SET ended_at = ?, outcome = ?, error = ?, cpu_s = ?, peak_memory_mib = ?, "
    "artifact_failed = ? WHERE work_id = ? AND attempt = ?"
)
HISTORIES = (
    f"SELECT w.rollout_id, {ATTEMPT_COLS} FROM attempts a "
    "JOIN work_items w ON w.id = a.work_id WHERE w.rollout_id IN ({marks}) ORDER BY a.attempt"
)
ATTEMPTS_FINISHED_SINCE = (
    "SELECT r.id, r.state, r.labels_json, w.attempt, a.attempt, a.host_id, a.started_at, "
    "a.ended_at, a.cpu_s, a.peak_memory_mib, a.device_s, a.id FROM rollouts r "
    "JOIN work_items w ON w.rollout_id = r.id JOIN attempts a ON a.work_id = w.id "
    "WHERE r.finished_at >= ? ORDER BY r.id, a.attempt"
)
"""For `fleet report`: every attempt of the rollouts that finished since a time."""
TOKENS_OF_ATTEMPTS_FINISHED_SINCE = (
    "SELECT t.attempt_id, t.model, t.prompt_tokens, t.completion_tokens FROM attempt_tokens t "
    "JOIN attempts a ON a.id = t.attempt_id JOIN work_items w ON w.id = a.work_id "
    "JOIN rollouts r ON r.id = w.rollout_id WHERE r.finished_at >= ?"
)
"""For `fleet report`: those attempts' tokens, by model."""
ROLLOUT_TOKENS = (
    "SELECT t.model, sum(t.prompt_tokens), sum(t.completion_tokens) FROM attempt_tokens t "
    "JOIN attempts a ON a.id = t.attempt_id JOIN work_items w ON w.id = a.work_id "
    "WHERE w.rollout_id = ? GROUP BY t.model ORDER BY t.model"
)
"""A rollout's language-model tokens by model, over all its attempts."""
CHARGE_DEVICE_SECONDS = (
    "UPDATE attempts SET device_s = device_s + ? WHERE id = (SELECT a.id FROM attempts a "
    "JOIN work_items w ON w.id = a.work_id WHERE w.rollout_id = ? "
    "ORDER BY a.started_at DESC, a.id DESC LIMIT 1)"
)
"""The gateway's device seconds, to a rollout's latest attempt."""
LATEST_ATTEMPT_OF_ROLLOUT = (
    "SELECT a.id FROM attempts a JOIN work_items w ON w.id = a.work_id WHERE w.rollout_id = ? "
    "ORDER BY a.started_at DESC, a.id DESC LIMIT 1"
)
CHARGE_TOKENS = (
    "UPDATE attempts SET prompt_tokens = prompt_tokens + ?, "
    "completion_tokens = completion_tokens + ? WHERE id = ?"
)
CHARGE_MODEL_TOKENS = (
    "INSERT INTO attempt_tokens (attempt_id, model, prompt_tokens, completion_tokens) "
    "VALUES (?, ?, ?, ?) ON CONFLICT (attempt_id, model) DO UPDATE SET "
    "prompt_tokens = attempt_tokens.prompt_tokens + excluded.prompt_tokens, "
    "completion_tokens = attempt_tokens.completion_tokens + excluded.completion_tokens"
)
"""The gateway's language-model tokens, to an attempt (in all, and by model)."""
OUTCOMES_ON_HOSTS_SINCE = (
    "SELECT outcome, artifact_failed, count(*) FROM attempts WHERE ended_at >= ? "
    "AND host_id IN ({marks}) GROUP BY outcome, artifact_failed"
)
OUTCOME_ON_HOSTS_SINCE = (
    "SELECT count(*) FROM attempts WHERE ended_at >= ? AND outcome = ? AND host_id IN ({marks})"
)

# -- checkpoints ---------------------------------------------------------------------------

INSERT_CHECKPOINT = (
    "INSERT INTO checkpoints (rollout_id, seq, attempt, data, created_at) "
    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (rollout_id, seq) DO NOTHING"
)
CHARGE_CHECKPOINT = (
    "INSERT INTO checkpoint_usage (rollout_id, bytes) VALUES (?, ?) ON CONFLICT (rollout_id) "
    "DO UPDATE SET bytes = checkpoint_usage.bytes + excluded.bytes RETURNING bytes"
)
"""Adds a checkpoint's charge to its rollout's; what the rollout holds now."""
REFUND_CHECKPOINT = "UPDATE checkpoint_usage SET bytes = bytes - ? WHERE rollout_id = ?"
DELETE_CHECKPOINT = "DELETE FROM checkpoints WHERE rollout_id = ? AND seq = ?"
CHECKPOINT_DATA = "SELECT data FROM checkpoints WHERE rollout_id = ? AND seq = ?"
CHECKPOINTS = "SELECT seq, attempt, data FROM checkpoints WHERE rollout_id = ? ORDER BY seq"
CHECKPOINT_INDEX = (
    "SELECT seq, attempt, length(data), created_at FROM checkpoints WHERE rollout_id = ? "
    "ORDER BY seq"
)
LATEST_CHECKPOINTS = (
    "SELECT c.rollout_id, c.seq, c.data FROM checkpoints c WHERE c.rollout_id IN ({marks}) "
    "AND c.seq = (SELECT max(seq) FROM checkpoints m WHERE m.rollout_id = c.rollout_id)"
)

# -- hosts ---------------------------------------------------------------------------------

REGISTER_HOST = (
    "INSERT INTO hosts (id, host_class, capabilities_json, last_heartbeat_at, registered_at, "
    "state, images_json, drain_by) VALUES (?, ?, ?, ?, ?, 'ready', '[]', '')"
)
REREGISTER_HOST = (
    "UPDATE hosts SET host_class = ?, capabilities_json = ?, last_heartbeat_at = ?, "
    "state = CASE WHEN drain_by = 'agent' THEN 'ready' ELSE state END, "
    "drain_deadline = CASE WHEN drain_by = 'agent' THEN NULL ELSE drain_deadline END, "
    "drain_by = CASE WHEN drain_by = 'agent' THEN '' ELSE drain_by END WHERE id = ?"
)
"""A host registering again: its own shutdown's drain ends (back in service)."""
HOST_BEAT = (
    "UPDATE hosts SET last_heartbeat_at = ?, images_json = coalesce(?, images_json) WHERE id = ?"
)
HOST_FOR_CLAIM = (
    "SELECT h.capabilities_json, i.revoked_at, h.state FROM hosts h "
    "LEFT JOIN host_identities i ON i.host_id = h.id WHERE h.id = ?"
)
HOST_STATES = "SELECT id, state FROM hosts"
SET_HOST_STATE = "UPDATE hosts SET state = ?, drain_deadline = ?, drain_by = ? WHERE id = ?"
AGENT_DRAINS = (
    "UPDATE hosts SET state = ?, drain_deadline = ?, drain_by = ? "
    "WHERE id = ? AND state NOT IN (?, ?)"
)
HOST_DRAINED = "UPDATE hosts SET state = ?, drain_deadline = NULL WHERE id = ?"
HOSTS_IN_STATE_FOR_UPDATE = "SELECT id, drain_deadline FROM hosts WHERE state = ? FOR UPDATE"
HOSTS_FOR_UPDATE = "SELECT id, capabilities_json, state FROM hosts ORDER BY id FOR UPDATE"
HOSTS_DRAINED_BY = "SELECT id FROM hosts WHERE drain_by = ? ORDER BY id"
READY_HOSTS_DRAINED_BY = (
    "UPDATE hosts SET state = ?, drain_deadline = NULL, drain_by = '' WHERE drain_by = ?"
)
HOSTS_CAPABILITIES = "SELECT capabilities_json FROM hosts"
HOSTS_AND_STATES = "SELECT capabilities_json, state FROM hosts"
HOSTS_OF_CLASS_AND_STATES = "SELECT capabilities_json, state FROM hosts WHERE host_class = ?"
UNREVOKED_HOSTS_CAPABILITIES = (
    "SELECT capabilities_json FROM hosts WHERE id NOT IN "
    "(SELECT host_id FROM host_identities WHERE revoked_at IS NOT NULL) ORDER BY id"
)
BECAME_DUE = (
    "SELECT count(*) FROM work_items WHERE state = ? AND attempt > 0 "
    "AND not_before > ? AND not_before <= ?"
)
"""Retries whose backoff ended within a window (queued items are few: a scan of ix_work_items_
claim's queued part)."""
LIVE_HOST_COUNT = "SELECT count(*) FROM hosts WHERE last_heartbeat_at >= ?"
HOST_TABLE = (
    "SELECT id, capabilities_json, state, last_heartbeat_at, images_json FROM hosts ORDER BY id"
)

# -- identity ------------------------------------------------------------------------------

JOIN_TOKEN_COLS = (
    "id, host_class, labels_json, created_at, expires_at, uses_left, revoked_at, secret_hash"
)
INSERT_JOIN_TOKEN = (
    "INSERT INTO join_tokens (id, secret_hash, host_class, labels_json, created_at, expires_at, "
    "uses_left) VALUES (?, ?, ?, ?, ?, ?, ?)"
)
JOIN_TOKENS = f"SELECT {JOIN_TOKEN_COLS} FROM join_tokens ORDER BY created_at"
JOIN_TOKEN_FOR_UPDATE = f"SELECT {JOIN_TOKEN_COLS} FROM join_tokens WHERE id = ? FOR UPDATE"
REVOKE_JOIN_TOKEN = "UPDATE join_tokens SET revoked_at = ? WHERE id = ?"
SPEND_JOIN_TOKEN = "UPDATE join_tokens SET uses_left = uses_left - 1 WHERE id = ?"
HOST_IDENTITY_COLS = (
    "host_id, host_class, labels_json, capabilities_json, token_id, enrolled_at, cert_serial, "
    "cert_expires_at, revoked_at"
)
HOST_IDENTITY = f"SELECT {HOST_IDENTITY_COLS} FROM host_identities WHERE host_id = ?"
HOST_IDENTITIES = f"SELECT {HOST_IDENTITY_COLS} FROM host_identities ORDER BY host_id"
HOST_REVOKED_AT = "SELECT revoked_at FROM host_identities WHERE host_id = ?"
REVOKED_HOSTS = "SELECT host_id FROM host_identities WHERE revoked_at IS NOT NULL"
INSERT_HOST_IDENTITY = (
    "INSERT INTO host_identities (host_id, host_class, labels_json, capabilities_json, token_id, "
    "enrolled_at, cert_serial, cert_expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
UPDATE_HOST_IDENTITY = (
    "UPDATE host_identities SET host_class = ?, capabilities_json = ?, cert_serial = ?, "
    "cert_expires_at = ?, labels_json = ? WHERE host_id = ?"
)
RENEW_HOST_CERTIFICATE = (
    "UPDATE host_identities SET cert_serial = ?, cert_expires_at = ? "
    "WHERE host_id = ? AND revoked_at IS NULL"
)
REVOKE_HOST = "UPDATE host_identities SET revoked_at = ? WHERE host_id = ? AND revoked_at IS NULL"
API_KEY_COLS = "id, tenant, scopes, created_at, expires_at, last_used_at, revoked_at, secret_hash"
INSERT_API_KEY = (
    "INSERT INTO api_keys (id, secret_hash, tenant, scopes, created_at, expires_at) "
    "VALUES (?, ?, ?, ?, ?, ?)"
)
API_KEYS = f"SELECT {API_KEY_COLS} FROM api_keys WHERE (? OR tenant = ?) ORDER BY created_at"
API_KEY = f"SELECT {API_KEY_COLS} FROM api_keys WHERE id = ?"
API_KEY_USED = "UPDATE api_keys SET last_used_at = ? WHERE id = ?"
REVOKE_API_KEY = "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL"

# -- pools ---------------------------------------------------------------------------------

POOL_COLS = (
    "name, host_class, labels_json, max_running, gates_json, adaptive_json, paused_at, "
    "paused_why, control_json"
)
POOLS = f"SELECT {POOL_COLS} FROM pools ORDER BY name"
POOL = f"SELECT {POOL_COLS} FROM pools WHERE name = ?"
POOL_FOR_UPDATE = POOL + " FOR UPDATE"
POOLS_LIMITING_CLASS_FOR_UPDATE = (
    f"SELECT {POOL_COLS} FROM pools WHERE host_class = ? "
    "AND (max_running > 0 OR paused_at IS NOT NULL) ORDER BY name FOR UPDATE"
)
"""The pools of a class that may hold a claim back: capped, or paused."""
POOLS_GOVERNED_FOR_UPDATE = (
    f"SELECT {POOL_COLS} FROM pools WHERE gates_json <> '{{}}' OR adaptive_json <> '' "
    "ORDER BY name FOR UPDATE"
)
"""The pools with gates or an adaptive cap."""
INSERT_POOL = (
    "INSERT INTO pools (host_class, labels_json, max_running, gates_json, adaptive_json, "
    "control_json, updated_at, name, paused_why) VALUES (?, ?, ?, ?, ?, ?, ?, ?, '')"
)
UPDATE_POOL = (
    "UPDATE pools SET host_class = ?, labels_json = ?, max_running = ?, gates_json = ?, "
    "adaptive_json = ?, control_json = ?, updated_at = ? WHERE name = ?"
)
DELETE_POOL = "DELETE FROM pools WHERE name = ?"
PAUSE_POOL = "UPDATE pools SET paused_at = ?, paused_why = ? WHERE name = ?"
RESUME_POOL = "UPDATE pools SET paused_at = NULL, paused_why = '' WHERE name = ?"
SET_POOL_CAP = "UPDATE pools SET max_running = ?, control_json = ? WHERE name = ?"
INSERT_POOL_EVENT = (
    "INSERT INTO pool_events (pool, at, kind, cap, message, figures_json) VALUES (?, ?, ?, ?, ?, ?)"
)
POOL_EVENTS_SINCE = (
    "SELECT seq, pool, at, kind, cap, message, figures_json FROM pool_events "
    "WHERE at >= ? AND (? OR pool = ?) ORDER BY seq DESC LIMIT ?"
)

# -- settings ------------------------------------------------------------------------------

SETTING = "SELECT value_json FROM settings WHERE key = ?"
SETTING_FOR_UPDATE = SETTING + " FOR UPDATE"
INSERT_SETTING = "INSERT INTO settings (key, value_json, updated_at) VALUES (?, ?, ?)"
DELETE_SETTING = "DELETE FROM settings WHERE key = ?"

# -- retention -----------------------------------------------------------------------------

FINISHED_BEFORE = (
    "SELECT id FROM rollouts r WHERE finished_at IS NOT NULL AND finished_at < ? "
    # The rollout that stores a parked session's layer: one that succeeded with it among its
    # outputs and either holds a session not closed (its `session_parks` row) or is a session's
    # own first rollout, parked by idleness (no row, and not a resume: none holds it now).
    "AND NOT (r.state = ? AND r.outputs_json LIKE ? AND (EXISTS (SELECT 1 FROM session_parks p "
    "WHERE p.rollout_id = r.id AND p.state <> ?) OR (r.labels_json NOT LIKE ? AND NOT EXISTS "
    "(SELECT 1 FROM session_parks p WHERE p.session_id = r.id OR p.rollout_id = r.id)))) "
    # A session's first rollout (its id, owner, opening) while a resume holds it, running or
    # parked in turn.
    "AND NOT EXISTS (SELECT 1 FROM session_parks p JOIN rollouts c ON c.id = p.rollout_id "
    "WHERE p.session_id = r.id AND p.rollout_id <> r.id AND p.state <> ? "
    "AND (c.finished_at IS NULL OR (c.state = ? AND c.outputs_json LIKE ?))) "
    "ORDER BY finished_at LIMIT ?"
)
"""Rollouts that ended before a time, oldest first, but for those a session that is not over
still needs (`fleet.ledger.retention`)."""
PURGE_ROLLOUTS = (
    "DELETE FROM attempt_tokens WHERE attempt_id IN (SELECT a.id FROM attempts a "
    "JOIN work_items w ON w.id = a.work_id WHERE w.rollout_id IN ({marks}))",
    "DELETE FROM attempts WHERE work_id IN "
    "(SELECT id FROM work_items WHERE rollout_id IN ({marks}))",
    "DELETE FROM work_items WHERE rollout_id IN ({marks})",
    *(
        f"DELETE FROM {table} WHERE rollout_id IN ({{marks}})"
        for table in ("events", "rollout_labels", "egress_events", "checkpoints",
                      "checkpoint_usage")
    ),
    "DELETE FROM session_parks WHERE session_id IN ({marks})",
    "DELETE FROM rollouts WHERE id IN ({marks})",
)  # fmt: skip
"""Everything of these rollouts, in an order their references allow (and the park record of
the sessions they opened)."""
PURGE_MANIFESTS = "DELETE FROM manifests WHERE digest NOT IN (SELECT manifest_digest FROM rollouts)"
PURGE_ARTIFACTS = (
    "DELETE FROM artifacts WHERE created_at < ? AND NOT EXISTS (SELECT 1 FROM rollouts r "
    "WHERE r.results_json LIKE '%' || artifacts.digest || '%')"
)
"""Step output older than a time that no remaining rollout's results name."""
MANIFESTS_STARTING_FROM_LAYERS = (
    'SELECT body FROM manifests m WHERE body LIKE \'%"layer":"sha256:%\' AND EXISTS '
    "(SELECT 1 FROM rollouts r WHERE r.manifest_digest = m.digest AND r.finished_at IS NULL)"
)
"""Manifests of rollouts not ended yet whose machine starts from a parked layer (a resume, a
fork of a parked session): the layer is fetched when the machine starts."""
