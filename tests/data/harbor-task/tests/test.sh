#!/bin/bash
# Reward 1 when the agent's files are right; the verifier runs in the same machine.
mkdir -p /logs/verifier
if [ "$(cat /app/greeting.txt)" = "hello from fleet" ] && [ "$(cat /app/count.txt)" = "4" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
cp /app/machine.txt /logs/verifier/machine.txt 2>/dev/null || true
