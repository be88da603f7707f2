set -x
cd "$(dirname "$0")/.."
S=.scratch/diag.py
# warm compile outside the tools
timeout 200 python $S rc 256 0 && timeout 200 python $S rc 256 0 pp && timeout 250 python $S prof 128 && timeout 250 python $S prof 256
{ for a in "256 0" "256 0 pp" "256 1"; do
  timeout 150 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 12 python $S rc $a; done; } > $OUT/rc.log 2>&1
SECS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis --section SourceCounters --section LaunchStats --section Occupancy"
for d in 128 256; do
  timeout 240 ncu --clock-control none -k 'regex:WsFwd|FlashAttention' --launch-skip 2 --launch-count 2 $SECS -o /tmp/p$d -f python $S prof $d > $OUT/ncu-run-$d.log 2>&1
  ncu --import /tmp/p$d.ncu-rep --page details > $OUT/details-$d.txt 2>&1
  ncu --import /tmp/p$d.ncu-rep --page source --csv --print-source sass > $OUT/source-$d.csv 2>&1
done
ncu --import /tmp/p128.ncu-rep --page raw --csv > $OUT/raw-128.csv 2>&1
ls -la $OUT
