# Sourced by the call scripts after DC=$REPO/.devcarry: a .devcarry folder not carried in this call is read from
# /tmp/stage, where the stage calls put it (tools/device/pack.py, stage.sh).
mkdir -p $DC
for group in cur1 cur2 gw1 gw2 pool bench; do
  [ -e $DC/$group ] || { [ -d /tmp/stage/$group ] && ln -s /tmp/stage/$group $DC/$group; }
done
