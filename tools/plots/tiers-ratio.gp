# input: tiers.csv
# Offloaded and adaptive decode as a fraction of resident, with the copy
# overlap that explains it.
load dir."/common.gp"
set title "Offloaded vs resident decode (same run, ratio of the medians of the rounds)"
set xlabel "context (tokens already in the KV cache)"
set ylabel "tokens/s relative to resident (1 = as fast)"
set y2label "copy overlap: 1 - stall/transfer (%)"
set logscale x 2
set yrange [0:*]
set y2range [0:105]
set ytics nomirror
set y2tics
set key bottom left
sel(m, c) = strcol("mode") eq m ? column(c) : NaN
plot 1 with lines dt 2 lc "gray" notitle, \
     csv using "ctx":(sel("offloaded", "ratio")) with linespoints lw 2 pt 5 lc 2 title "offloaded / resident", \
     csv using "ctx":(sel("adaptive", "ratio")) with linespoints lw 2 pt 9 lc 3 title "adaptive / resident", \
     csv using "ctx":(sel("offloaded", "overlap_pct")) axes x1y2 with linespoints dt 3 pt 4 lc 2 title "offloaded overlap (right axis)", \
     csv using "ctx":(sel("adaptive", "overlap_pct")) axes x1y2 with linespoints dt 3 pt 8 lc 3 title "adaptive overlap (right axis)"
