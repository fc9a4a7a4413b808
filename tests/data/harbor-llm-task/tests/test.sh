#!/bin/bash
# Reward 1 when the agent reached the model with its rollout's token, and the host's key was
# nowhere in its environment (nor is it in the verifier's).
mkdir -p /logs/verifier
cp /app/llm.json /logs/verifier/llm.json 2>/dev/null || true
if python3 -c '
import json, os, sys
seen = json.load(open("/app/llm.json"))
host = any("sk-host" in v for v in os.environ.values())
sys.exit(0 if seen["key_is_rollout_token"] and not seen["host_key_seen"] and not host else 1)
'; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
