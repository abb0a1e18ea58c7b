# input: prefix.csv
# Time to first token with the prompt's prefix computed (cold) and found
# in the prefix cache (warm), against the prefix length.
load dir."/common.gp"
set title "Time to first token: prefix-cache hit vs cold prompt (best of 3)"
set xlabel "shared prefix (tokens); every prompt adds its own suffix"
set ylabel "time to first token (ms, log scale)"
set logscale y
set format y "%.0f"
plot csv using "prefix_tokens":"ttft_cold_ms" with linespoints lw 2 pt 7 title "cold: whole prompt computed", \
     csv using "prefix_tokens":"ttft_warm_ms" with linespoints lw 2 pt 5 title "warm: prefix from the cache, suffix computed"
