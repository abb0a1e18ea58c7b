# input: tiers.csv
# Decode tokens/s against context length, one line per KV placement.
load dir."/common.gp"
set title "Decode speed vs context, per KV strategy (median of the rounds)"
set xlabel "context (tokens already in the KV cache)"
set ylabel "decode speed (tokens/s)"
set logscale x 2
set yrange [0:*]
sel(m) = strcol("mode") eq m ? column("tok_s") : NaN
plot csv using "ctx":(sel("resident")) with linespoints lw 2 pt 7 title "resident (dynamic, every layer on the device)", \
     csv using "ctx":(sel("offloaded")) with linespoints lw 2 pt 5 title "offloaded (every layer streamed from the host tier)", \
     csv using "ctx":(sel("adaptive")) with linespoints lw 2 pt 9 title "adaptive (half the layers resident)"
