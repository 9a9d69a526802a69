#!/bin/bash
# Device stage call (tools/device/pack.py): carry one .devcarry/stage/NN; its files join /tmp/stage, and each file
# whose parts are all in is joined. After the last folder every file is checked against SHA256SUMS, and the call
# scripts read /tmp/stage/<group> (cur1, cur2, gw1, gw2, pool, bench) where the .devcarry folder is not carried.
ST=/tmp/stage; mkdir -p $ST
# A carried folder stays on the device between calls: drop it once copied, or the next call would copy it again.
for d in .devcarry/stage/*/; do cp -r "$d". $ST/ && rm -rf "$d" && echo "staged $d"; done
python3 tools/device/pack.py --join $ST
