#!/bin/bash
# The agent's side: the OpenAI API as its environment describes it, with the standard library.
set -euo pipefail
python3 - <<'PY'
import json, os, urllib.request

base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
body = {"model": "tiny-test-r1", "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4, "temperature": 0}
request = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + key,
                                          "Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request, timeout=60))
seen = {
    "base": base,
    "key_is_rollout_token": key == os.environ.get("FLEET_INFERENCE_TOKEN"),
    "rollout": os.environ.get("FLEET_ROLLOUT_ID"),
    "host_key_seen": any("sk-host" in v for v in os.environ.values()),
    "completion_tokens": answer["usage"]["completion_tokens"],
}
with open("/app/llm.json", "w") as f:
    json.dump(seen, f)
PY
