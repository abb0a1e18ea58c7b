#!/bin/sh
# plots.sh [DIR] - renders the figures of docs/benchmarks.md: for every
# tools/plots/NAME.gp, DIR/NAME.svg (DIR: docs/figures) from the CSV its
# "# input:" line names, which a benchmark tool wrote with --csv.  Each
# figure quotes the machine, date and command from the CSV's preamble.
set -e
dir=${1:-docs/figures}
gp_dir=$(dirname "$0")/plots
if ! command -v gnuplot >/dev/null 2>&1; then
  echo "plots.sh: gnuplot is not installed (tools/deps.sh plot installs it)" >&2
  exit 1
fi
# a value inside a gnuplot single-quoted string, where '' is a quote
field() { sed -n "s/^# $1: //p" "$2" | head -n 1 | sed "s/'/''/g"; }
n=0
for gp in "$gp_dir"/*.gp; do
  in=$(sed -n 's/^# input: //p' "$gp")
  [ -n "$in" ] || continue  # common.gp
  csv=$dir/$in
  if [ ! -f "$csv" ]; then
    echo "plots.sh: $csv is missing (see docs/benchmarks.md \"Figures\" for the command that writes it)" >&2
    exit 1
  fi
  out=$dir/$(basename "$gp" .gp).svg
  gnuplot -e "dir='$gp_dir'; csv='$csv'; out='$out'; machine='$(field machine "$csv")'; date='$(field date "$csv")'; command='$(field command "$csv")'" "$gp"
  n=$((n + 1))
done
echo "plots.sh: $n figure(s) written to $dir"
