#!/bin/bash
set -euo pipefail
echo "hello from fleet" > /app/greeting.txt
wc -w < /app/words.txt > /app/count.txt
hostname > /app/machine.txt
